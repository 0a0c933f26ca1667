"""One step of a moeforge layer on torch's memory, for moeforge.torch: the
compiled layer (training program or forward alone, GPU or CPU backend)
bound to torch's tensors in place, each step's saved parts and workspaces
taken from torch's caching allocator, and the forward, backward and
inference forward that the custom ops run. The module (MoELayer) and the
ops live in moeforge.torch; this file knows nothing of autograd or
torch.compile."""

import math

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
    # Every tensor the layer reads is floating point: an integer or boolean
    # tensor (token ids where activations belong, say) would otherwise be
    # converted to bf16 and run as numbers.
    if not t.is_floating_point():  # complex tensors too: not real values
        raise mf.UserError(f"{what} has dtype {t.dtype}; the layer reads floating-point values (bf16, f16 or f32): "
                           "pass activations, not indices or masks")


def _as_layer_tensor(layer, name, t):
    """t in the layer's storage type and shape, contiguous: t itself when it
    already is (no copy), else a converted copy."""
    dtype, shape, _, _ = layer.info(name)
    if tuple(t.shape) != tuple(shape):
        raise mf.UserError(f"'{name}' has shape {tuple(t.shape)}; the layer expects {tuple(shape)}")
    return t.detach().to(_DTYPES[dtype]).contiguous()


def _whole_shape(whole, decls, members):
    """The shape of a tensor holding `members` (Params (n0, n1, n2, ...) at
    their offsets in elements, each stored every outer_stride elements along
    n0) as one tensor (n0, m1, n2, ...), and whether they cover all of it;
    a UserError where they do not fit it or overlap."""
    shapes = {tuple(b["shape"]) for b in decls}
    strides = {b["outer_stride"] for b in decls}
    first = tuple(decls[0]["shape"])
    rest = math.prod(first[2:])
    if len(shapes) != 1 or len(strides) != 1 or len(first) < 2 or next(iter(strides)) % rest:
        raise mf.UserError(f"stored_in['{whole}']: its Params must have one shape of two dims or more and one "
                           f"outer_stride, a whole number of rows of their second dim; got "
                           f"{[(b['name'], tuple(b['shape']), b['outer_stride']) for b in decls]}")
    stride = next(iter(strides))
    inner = math.prod(first[1:])
    spans = sorted((offset, offset + inner, p) for p, offset in members)
    for (a0, a1, pa), (b0, b1, pb) in zip(spans, spans[1:]):
        if b0 < a1:
            raise mf.UserError(f"stored_in['{whole}']: '{pa}' at {a0} and '{pb}' at {b0} overlap ({inner} elements "
                               "each)")
    if spans[0][0] < 0 or spans[-1][1] > stride:
        raise mf.UserError(f"stored_in['{whole}']: each Param's offset must lie in [0, {stride - inner}] (its "
                           f"outer_stride {stride} less its {inner} elements)")
    covered = sum(b - a for a, b, _ in spans) == stride
    return (first[0], stride // rest, *first[2:]), covered


def _empty_like_layer(layer, name, device):
    dtype, shape, _, _ = layer.info(name)
    return torch.empty(shape, dtype=_DTYPES[dtype], device=device)


def _address(t):
    """A device address for the layer: 0 for no memory (an empty workspace)."""
    return 0 if t is None else t.data_ptr()


def _memory(nbytes, device):
    """Bytes from torch's caching allocator (its blocks are 512-byte aligned,
    as the layer's regions must be), or None for none."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device) if nbytes else None


class _BoundLayer:
    """What both runtimes share: binding torch's tensors (an unchanged
    address costs nothing, but a call each) and copying out the experts a
    forward chose."""

    def bind(self, name, t, offset=0, nbytes=None):
        """Points the layer's tensor `name` at t's memory, `offset` bytes in
        (a Param inside a larger tensor), over `nbytes` (default: t's)."""
        address = t.data_ptr() + offset
        if self.bound.get(name) != address:
            self.layer.bind(name, address, t.numel() * t.element_size() if nbytes is None else nbytes)
            self.bound[name] = address

    def forward(self, device, saved, workspace):
        """The layer's forward on torch's current stream: `saved` its saved
        parts' addresses (the training program) or its tables' (the
        forward alone)."""
        if self.cuda:
            self.layer.forward(_stream(device), saved, workspace)
        else:
            self.layer.forward(saved, workspace)

    def routed_experts(self, route, device):
        """A copy of the experts the forward just run chose: T * k int32,
        on the module's device (the tables live in that forward's memory)."""
        if not self.cuda:
            return torch.from_numpy(self.layer.routed_experts(route).copy())
        t = torch.empty(self.layer.pairs(route), dtype=torch.int32, device=device)
        self.layer.copy_routed_experts(route, t.data_ptr(), t.numel() * 4, _stream(device))
        return t


class _Runtime(_BoundLayer):
    """The module's one compiled training program on caller memory (the
    GPU's or the CPU backend's), and the token count and addresses it was
    last given."""

    def __init__(self, module, tokens):
        self.cuda = module.device.type == "cuda"
        if self.cuda:
            with torch.cuda.device(module.device):
                self.layer = mf.CudaTrainingLayer(module.pipeline, module.outputs, module.schedule, tokens,
                                                  module.device.index or 0, caller_memory=True)
            # One graph launch per entry point while torch's allocator hands
            # back the same blocks step after step: a short layer's ~30
            # launches would otherwise show in its step time.
            self.layer.replay_graphs(True)
        else:
            self.layer = mf.CpuCallerTrainingLayer(module.pipeline, module.outputs, module.schedule, tokens)
        self.tokens = None
        self.bound = {}
        self.memory = {}  # tokens -> ([saved parts], forward workspace, backward workspace) bytes
        self.backward_reads = set(self.layer.backward_reads)
        self._saved_terms = False  # not asked yet

    def saved_terms(self):
        if self._saved_terms is False:
            self._saved_terms = self.layer.saved_terms()
        return self._saved_terms

    def use_tokens(self, tokens):
        if tokens != self.tokens:
            self.layer.set_tokens(tokens)
            self.tokens = tokens
            self.bound.clear()  # what changed size is unbound; the rest binds again at no cost
        if tokens not in self.memory:
            if len(self.memory) >= 64:  # a model of ever-new counts keeps no growing table
                self.memory.clear()
            self.memory[tokens] = self.layer.step_memory(tokens)
        return self.memory[tokens]

    def backward(self, stream, saved, workspace):
        if self.cuda:
            self.layer.backward(stream.cuda_stream, saved, workspace)
        else:
            self.layer.backward(saved, workspace)


def _step_forward(module, xs, params, consts, zero_saved=False):
    """One forward on caller memory: the outputs and the saved parts its
    backward reads (uint8 tensors of torch's: the activations', then the
    small values' and the routing tables'; one empty one at no tokens),
    zeroed first where zero_saved (moeforge.torch.zero_saved says why)."""
    x = xs[0]
    tokens = x.shape[0]
    module._routing_tokens = tokens
    if tokens == 0:
        module._routing = {}
        outs = [module._no_token_output(f, dtype, x.device) for f, dtype in zip(module.outputs, module._output_dtypes)]
        return outs, [torch.empty(0, dtype=torch.uint8, device=x.device)]
    rt = module._runtime(tokens)
    layer = rt.layer
    part_bytes, workspace_bytes, _ = rt.use_tokens(tokens)
    # The input and weights and fresh output tensors, all bound in place
    # (a converted copy held here until the forward has run).
    inputs = _layer_inputs(module, layer, xs, params, consts)
    for binding in inputs:
        rt.bind(*binding)
    # The workspace is taken first: it then gets the block the last call's
    # workspace left in torch's pool, the same size, and the saved parts
    # blocks of their own, instead of a split of it (splits of layer after
    # layer fragmented an 8-layer stack's pool by 3 GiB). Each part is a
    # tensor of its own, as autograd's saved tensors are, so the allocator
    # fits each where it fits (in a stack, the blocks the weight gradients
    # left; one block of their sum fits none of those and takes new memory).
    workspace = _memory(workspace_bytes, x.device)
    saved = [_memory(n, x.device) if n else torch.empty(0, dtype=torch.uint8, device=x.device) for n in part_bytes]
    if zero_saved:
        for part in saved:
            part.zero_()
    outs = [_empty_like_layer(layer, name, x.device) for name in layer.outputs]
    for name, t in zip(layer.outputs, outs):
        rt.bind(name, t)
    rt.forward(x.device, [part.data_ptr() for part in saved], _address(workspace))
    del workspace  # back to torch's pool; work queued later on this stream reuses it after ours
    module._record_routing(rt, x.device)
    return outs, saved


def _layer_inputs(module, layer, xs, params, consts):
    """What a step binds, as (layer tensor, torch tensor, byte offset, bytes)
    of the token inputs, the weights and the constant inputs, each in the
    layer's storage type, contiguous: themselves where they already are (no
    copy). A weight tensor holding several Params (stored_in) binds each at
    its place in it."""
    out = [(name, _as_layer_tensor(layer, name, t), 0, None)
           for name, t in zip(module.input_names, xs)]
    for weight, t in zip(module._weight_names, params):
        members = module._members[weight]
        if module._alone(weight):
            out.append((weight, _as_layer_tensor(layer, weight, t), 0, None))
            continue
        whole = t.detach().to(_DTYPES[layer.info(members[0][0])[0]]).contiguous()
        out += [(p, whole, offset * whole.element_size(), layer.info(p)[3]) for p, offset in members]
    return out + [(name, _as_layer_tensor(layer, name, t), 0, None) for name, t in zip(module._const_names, consts)]


def _step_backward(module, xs, params, consts, saved, read_outputs, grads):
    """The backward of the forward whose saved parts `saved` are: every
    token input's and Param's gradient, in the layer's storage types."""
    x = xs[0]
    tokens = x.shape[0]
    if tokens == 0:  # nothing routed: no gradient reaches anything
        return [torch.zeros_like(t) for t in xs] + [torch.zeros_like(p) for p in params]
    rt = module._runtime(tokens)
    layer = rt.layer
    device = x.device
    _, _, workspace_bytes = rt.use_tokens(tokens)
    # The forward's input, weights and the outputs the backward reads, bound
    # again (a model may have run other forwards since). Autograd runs a
    # backward on its forward's stream, so no stream needs recording.
    inputs = _layer_inputs(module, layer, xs, params, consts)  # held until the backward has run
    for binding in inputs:
        rt.bind(*binding)
    for name, t in zip([n for n in layer.outputs if n in rt.backward_reads], read_outputs):
        rt.bind(name, t)
    seeds = []
    for seed, g in zip(layer.seeds, grads):
        seeds.append(_as_layer_tensor(layer, seed, g))
        rt.bind(seed, seeds[-1])
    # The workspace first, as in the forward: the last backward's block.
    workspace = _memory(workspace_bytes, device)
    # Every gradient gets fresh memory, needed or not: the layer writes
    # them all, and never into memory torch may have handed elsewhere.
    out = [_empty_like_layer(layer, layer.gradients[name], device) for name in module.input_names]
    for name, t in zip(module.input_names, out):
        layer.bind_gradient(name, t.data_ptr(), t.numel() * t.element_size())
    for weight in module._weight_names:
        members = module._members[weight]
        if module._alone(weight):
            out.append(_empty_like_layer(layer, layer.gradients[weight], device))
            layer.bind_gradient(weight, out[-1].data_ptr(), out[-1].numel() * out[-1].element_size())
            continue
        # One gradient tensor for the weight tensor, each Param's written in
        # its place; zeros where no Param lies (nothing writes there).
        dtype = _DTYPES[layer.info(layer.gradients[members[0][0]])[0]]
        make = torch.empty if module._covered[weight] else torch.zeros
        out.append(make(module._weight_shapes[weight], dtype=dtype, device=device))
        for p, offset in members:
            layer.bind_gradient(p, out[-1].data_ptr() + offset * out[-1].element_size(),
                                layer.info(layer.gradients[p])[3])
    stream = torch.cuda.current_stream(device) if rt.cuda else None
    rt.backward(stream, [part.data_ptr() for part in saved], _address(workspace))
    # The workspace and the seeds go back to torch's pool now (a block freed
    # on this stream is handed only to work queued on it after the kernels
    # above); the saved parts when autograd drops them.
    return out


class _ForwardRuntime(_BoundLayer):
    """The module's forward alone (inference: nothing kept for a backward),
    compiled once on caller memory, for forwards under torch.no_grad() or
    torch.inference_mode() or with nothing that needs a gradient."""

    def __init__(self, module, tokens, schedule):
        self.cuda = module.device.type == "cuda"
        if self.cuda:
            with torch.cuda.device(module.device):
                self.layer = mf.CudaCallerLayer(module.pipeline, schedule, tokens, module.device.index or 0)
            # One graph launch per forward once torch's allocator hands back
            # the same blocks: a decoding step's kernels take microseconds,
            # so their launches would be most of its time.
            self.layer.replay_graphs(True)
        else:
            self.layer = mf.CpuCallerLayer(module.pipeline, schedule, tokens)
        self.tokens = None
        self.bound = {}

    def use_tokens(self, tokens):
        if tokens != self.tokens:
            self.layer.set_tokens(tokens)
            self.tokens = tokens
            self.bound.clear()
        return self.layer.step_memory(tokens)


def _inference_forward(module, xs, params, consts):
    """The forward alone: the outputs, in the dtypes the training step gives
    them (one dtype whatever the grad mode)."""
    x = xs[0]
    tokens = x.shape[0]
    module._routing_tokens = tokens
    if tokens == 0:
        module._routing = {}
        return [module._no_token_output(f, dtype, x.device) for f, dtype in zip(module.outputs, module._output_dtypes)]
    rt = module._forward_runtime(tokens)
    layer = rt.layer
    tables_bytes, workspace_bytes = rt.use_tokens(tokens)
    inputs = _layer_inputs(module, layer, xs, params, consts)  # held until the forward has run
    for binding in inputs:
        rt.bind(*binding)
    workspace = _memory(workspace_bytes, x.device)
    tables = _memory(tables_bytes, x.device)
    wanted = [f.name for f in module.outputs]
    outs = {name: _empty_like_layer(layer, name, x.device) for name in layer.outputs}
    for name, t in outs.items():
        rt.bind(name, t)
    rt.forward(x.device, tables.data_ptr(), _address(workspace))
    module._record_routing(rt, x.device)
    # The tables and the workspace go back to torch's pool (on the GPU, to
    # work queued after ours on this stream).
    return [outs[n] if outs[n].dtype == dtype else outs[n].to(dtype) for n, dtype in zip(wanted, module._output_dtypes)]
