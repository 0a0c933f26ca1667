"""moeforge.torch: a layer written in the algebra as a torch.nn.Module.

    import moeforge as mf
    import moeforge.torch as mft

    moe = mft.MoELayer(pipeline, schedule=mf.scattermoe())      # or mft.example("moe_mlp", ...)
    y = moe(x)                 # x: (tokens, d) on the GPU; y: the layer's output
    y.float().pow(2).mean().backward()   # fills moe.w1.grad, ..., and x.grad

The forward and backward are the compiled training program's two entry
points (moeforge.CudaTrainingLayer), run through a torch.autograd.Function on
torch's current CUDA stream. The layer reads and writes torch's tensors in
place (its input, weights, outputs, upstream gradients and gradients are
bound to their memory: no copies), nothing synchronises with the host, and
a step can be captured in a CUDA graph (torch.cuda.graph) after a warm-up
step outside it. The layer's Params are the module's nn.Parameters (bf16
by default, as the algebra declares them); its one Input is the argument of
forward(); with auxiliary losses among the outputs, forward() returns the
output and the losses as tensors.

One forward is in flight per module: the training program keeps the
activations of the last forward for the next backward, so a second forward
before the first one's backward (activation checkpointing, the same module
twice in one graph) raises an error instead of giving wrong gradients.

torch.compile: the module runs as an opaque call (a graph break around it,
torch.compiler.disable); it is not a torch.library custom op yet.
"""

import math
import warnings

import torch

import moeforge as mf

_DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32, "f16": torch.float16}


def _stream(device):
    return torch.cuda.current_stream(device).cuda_stream


def _check_tensor(what, t, device):
    if not isinstance(t, torch.Tensor):
        raise mf.UserError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise mf.UserError(f"{what} is on {t.device}, the layer on {device}: move it with .to('{device}')")


def _as_layer_tensor(layer, name, t):
    """t in the layer's storage type and shape, contiguous: t itself when it
    already is (no copy), else a converted copy."""
    dtype, shape, _, _ = layer.info(name)
    if tuple(t.shape) != tuple(shape):
        raise mf.UserError(f"'{name}' has shape {tuple(t.shape)}; the layer expects {tuple(shape)}")
    return t.detach().to(_DTYPES[dtype]).contiguous()


def _bind(layer, name, t, bound):
    """Points the layer's tensor `name` at t's memory (no copy); `bound`
    remembers the address so an unchanged one is not bound again."""
    if bound.get(name) != t.data_ptr():
        layer.bind(name, t.data_ptr(), t.numel() * t.element_size())
        bound[name] = t.data_ptr()


def _empty_like_layer(layer, name, device):
    dtype, shape, _, _ = layer.info(name)
    return torch.empty(shape, dtype=_DTYPES[dtype], device=device)


def _cpu_forward(module, layer, x, params):
    """The CPU backend: values go in and out through numpy (its layers keep
    bf16 storage of their own, so a copy happens anyway)."""
    arrays = {module.input_name: x.detach().float().numpy()}
    arrays.update({name: p.detach().float().numpy() for name, p in zip(module._param_names, params)})
    layer.upload(arrays)
    layer.forward()
    return [torch.from_numpy(layer.output(f.name)).to(_DTYPES[f.dtype.name]) for f in module.outputs]


def _cpu_backward(module, layer, grads, outs):
    for f, g, out in zip(module.outputs, grads, outs):
        g = torch.zeros_like(out) if g is None else g
        layer.upload_upstream_gradient(g.detach().double().numpy(), f.name)
    layer.backward()
    return [torch.from_numpy(layer.gradient(name)) for name in [module.input_name] + module._param_names]


class _TrainingStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, module, x, *params):
        layer, bound = module._layer_for(x)
        ctx.input_dtypes = [x.dtype] + [p.dtype for p in params]
        if module.device.type == "cpu":
            outs = _cpu_forward(module, layer, x, params)
            module._generation += 1
            ctx.module, ctx.layer, ctx.generation = module, layer, module._generation
            ctx.save_for_backward(*outs)
            return tuple(outs) if len(outs) > 1 else outs[0]
        # Everything the layer reads or writes is a torch tensor bound in
        # place: the input and weights (read again by the backward, so kept
        # in ctx), and fresh output tensors.
        keep = [_as_layer_tensor(layer, module.input_name, x)]
        keep += [_as_layer_tensor(layer, name, p) for name, p in zip(module._param_names, params)]
        for name, t in zip([module.input_name] + module._param_names, keep):
            _bind(layer, name, t, bound)
        outs = [_empty_like_layer(layer, name, x.device) for name in layer.outputs]
        for name, t in zip(layer.outputs, outs):
            _bind(layer, name, t, bound)
        layer.forward(_stream(x.device))
        module._generation += 1
        ctx.module, ctx.layer, ctx.bound, ctx.generation = module, layer, bound, module._generation
        ctx.keep = keep
        ctx.save_for_backward(*outs)  # a backward may read them; torch checks they stay unmodified
        return tuple(outs) if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        module, layer = ctx.module, ctx.layer
        if module._generation != ctx.generation:
            raise RuntimeError(
                "moeforge.torch: this backward belongs to an earlier forward of the same module, whose "
                "activations a later forward replaced; run each forward's backward before the next forward "
                "(no activation checkpointing or reuse of one module twice in a graph)")
        outs = ctx.saved_tensors  # raises if an output was modified in place since the forward
        if module.device.type == "cpu":
            got = _cpu_backward(module, layer, grads, outs)
            return (None, *[g.to(dtype) if need else None
                            for g, dtype, need in zip(got, ctx.input_dtypes, ctx.needs_input_grad[1:])])
        bound = ctx.bound
        device = ctx.keep[0].device
        seeds = []
        for seed, g in zip(layer.seeds, grads):
            if g is None:
                g = _empty_like_layer(layer, seed, device).zero_()
            seeds.append(_as_layer_tensor(layer, seed, g))
            _bind(layer, seed, seeds[-1], bound)
        # Every gradient gets fresh memory, needed or not: the layer writes
        # them all, and never into memory torch may have handed elsewhere.
        names = [module.input_name] + module._param_names
        out = [_empty_like_layer(layer, layer.gradients[name], device) for name in names]
        for name, t in zip(names, out):
            layer.bind_gradient(name, t.data_ptr(), t.numel() * t.element_size())
        layer.backward(_stream(device))
        result = [None]
        for t, dtype, need in zip(out, ctx.input_dtypes, ctx.needs_input_grad[1:]):
            result.append((t if t.dtype == dtype else t.to(dtype)) if need else None)
        ctx.seeds = seeds  # read by the backward's kernels after we return
        return tuple(result)


class MoELayer(torch.nn.Module):
    """A layer of the algebra as a module: its Params become nn.Parameters.

    pipeline: the layer (moeforge.Pipeline); outputs: the Funcs forward()
    returns (default: the pipeline's outputs, e.g. [y] or [y, lb_loss]);
    schedule: a moeforge.Schedule or a preset name; init_scale: {param name:
    half-width of its uniform init} (default 1/sqrt(fan-in), the first
    non-expert dimension); device: where the parameters live and the layer
runs: a GPU ('cuda', the CUDA backend) or 'cpu' (the LLVM CPU backend,
values through numpy: for development and tests, not speed).
    """

    def __init__(self, pipeline, outputs=None, schedule="scattermoe", init_scale=None, device="cuda", dtype=None):
        super().__init__()
        self.device = torch.device(device)
        if self.device.type == "cuda":
            ok, why = mf.gpu_available()
            if not ok:
                raise mf.UserError(f"moeforge.torch on the GPU: {why}; device='cpu' runs the CPU backend")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
        elif self.device.type == "cpu":
            if not mf.has_cpu_backend:
                raise mf.UserError("moeforge was built without the CPU backend (LLVM): use device='cuda'")
        else:
            raise mf.UserError(f"device must be 'cuda' or 'cpu', got '{device}'")
        self.pipeline = pipeline
        self.outputs = list(outputs) if outputs is not None else list(pipeline.outputs)
        self.schedule = mf.preset(schedule) if isinstance(schedule, str) else schedule
        # A choice the layer does not take would otherwise run as if absent, unseen.
        for note in mf.not_applied(pipeline, self.schedule, self.outputs):
            warnings.warn(f"moeforge: {note}", stacklevel=2)
        decls = pipeline.buffer_decls
        inputs = [b for b in decls if b["kind"] == "input"]
        if len(inputs) != 1:
            raise mf.UserError(
                f"MoELayer takes a layer with exactly one Input (the tokens), got {[b['name'] for b in inputs]}")
        self.input_name = inputs[0]["name"]
        self._input_shape = tuple(inputs[0]["shape"])  # None: the token Dim
        self._param_names = []
        init_scale = init_scale or {}
        for b in decls:
            if b["kind"] != "param":
                continue
            shape = tuple(b["shape"])
            if any(s is None for s in shape):
                raise mf.UserError(f"Param '{b['name']}' has the token Dim: a weight cannot grow with the tokens")
            fan_in = shape[-2] if len(shape) >= 2 else shape[-1]
            scale = init_scale.get(b["name"], 1.0 / math.sqrt(fan_in))
            p = torch.empty(shape, dtype=dtype or _DTYPES[b["dtype"]], device=self.device)
            with torch.no_grad():
                p.uniform_(-scale, scale)
            self.register_parameter(b["name"], torch.nn.Parameter(p))
            self._param_names.append(b["name"])
        self._layers = {}  # tokens -> (CudaTrainingLayer, {tensor name: address bound})
        self._generation = 0

    def _layer_for(self, x):
        if x.dim() != 2:
            raise mf.UserError(f"the input '{self.input_name}' must be (tokens, width), got shape {tuple(x.shape)}")
        tokens = x.shape[0]
        if tokens not in self._layers and self.device.type == "cpu":
            self._layers[tokens] = (mf.CpuTrainingLayer(self.pipeline, self.outputs, self.schedule, tokens), {})
        if tokens not in self._layers:
            with torch.cuda.device(self.device):
                layer = mf.CudaTrainingLayer(self.pipeline, self.outputs, self.schedule, tokens,
                                             self.device.index or 0)
            # One graph launch per entry point while torch's allocator hands
            # back the same blocks step after step: a short layer's ~30
            # launches would otherwise show in its step time.
            layer.replay_graphs(True)
            self._layers[tokens] = (layer, {})
        return self._layers[tokens]

    @torch.compiler.disable
    def forward(self, x):
        _check_tensor(f"the input '{self.input_name}'", x, self.device)
        if x.dim() == len(self._input_shape):
            want = tuple(x.shape[0] if s is None else s for s in self._input_shape)
            if tuple(x.shape) != want:
                raise mf.UserError(f"'{self.input_name}' has shape {tuple(x.shape)}; the layer expects {want}")
        params = [getattr(self, name) for name in self._param_names]
        return _TrainingStep.apply(self, x, *params)

    def routed_experts(self, tokens, route="route"):
        """The experts the last forward over `tokens` tokens chose, pair order."""
        return torch.from_numpy(self._layers[tokens][0].routed_experts(route).copy())

    def saved_bytes(self, tokens):
        """What the forward keeps for the backward at `tokens` tokens."""
        return self._layers[tokens][0].saved_bytes


def example(name, experts=8, topk=2, d=64, f=128, schedule="scattermoe", device="cuda", **kwargs):
    """A ready-made layer (moeforge.example_names()) as a MoELayer."""
    ex, _ = mf.make_example(name, tokens=1, experts=experts, topk=topk, d=d, f=f)
    return MoELayer(ex.pipeline, schedule=schedule, init_scale=dict(ex.init_scale), device=device, **kwargs)
