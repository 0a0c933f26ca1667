"""moeforge.torch: a layer written in the algebra as a torch.nn.Module.

    import moeforge as mf
    import moeforge.torch as mft

    moe = mft.MoELayer(pipeline, schedule=mf.scattermoe())      # or mft.example("moe_mlp", ...)
    y = moe(x)                 # x: (tokens, d) or (batch, seq, d) on the GPU; y: the layer's output
    y.float().pow(2).mean().backward()   # fills moe.w1.grad, ..., and x.grad

The forward and backward are the compiled training program's two entry
points (moeforge.CudaTrainingLayer on caller memory), run as torch.library
custom ops on torch's current CUDA stream. The layer reads and writes torch's tensors in
place (its input, weights, outputs, upstream gradients and gradients are
bound to their memory: no copies), nothing synchronises with the host, and
a step can be captured in a CUDA graph (torch.cuda.graph) after a warm-up
step outside it. The layer's Params are the module's nn.Parameters (bf16
by default, as the algebra declares them); its Inputs over the tokens are
the arguments of forward() (x, and where the layer takes a given routing,
its scores), and its other Inputs (DeepSeek's selection-only expert bias)
are buffers, read by every forward and given no gradient; with
auxiliary losses among the outputs, forward() returns the output and the
losses as tensors.

Memory: the module compiles one program and holds no memory of its own
besides its parameters. Each forward takes from torch's caching allocator
the memory for the activations its backward reads (kept with the autograd
graph until that backward ends) and a workspace for its temporaries
(returned when the forward is enqueued); each backward takes a workspace
of its own. So any number of forwards may be in flight (activation
checkpointing, gradient accumulation, the module applied twice, several
micro-batches), each backward reads its own forward's activations, and a
new token count costs no compile and no memory that outlives the step. A
step of no tokens returns empty outputs and zero gradients. Where no
backward will run (torch.no_grad(), torch.inference_mode(), nothing that
needs a gradient) the module runs the layer's forward program alone
(moeforge.CudaCallerLayer): nothing is kept for a backward.

On the CPU backend (device='cpu', for development and tests) the module
runs the same way: the CPU layer on caller memory (moeforge.CpuCallerTrainingLayer)
reads and writes torch's CPU tensors in place, each forward's activations
in a tensor of torch's, so forwards in flight, checkpointing and any token
count behave as on the GPU.

torch.compile: the forward, the backward and the forward alone are
torch.library custom ops (moeforge::layer_forward, moeforge::layer_backward,
moeforge::layer_inference) with fake kernels, so
torch.compile(model, fullgraph=True) traces a model holding the module with
no graph break, at any token count (dynamic shapes), and the ops pass
torch.library.opcheck (with zero_saved = True: it compares the saved parts
bit for bit). At a symbolic count the forward's fake kernel sizes the saved
parts from the layer's terms over the count (saved_terms(): the bytes the
layer lays out, as an expression of it), so mode="reduce-overhead" records
and replays the step in CUDA graphs at static and symbolic counts alike.
"""

import itertools
import os
import math
import warnings
import weakref

import torch

import moeforge as mf
from moeforge._torch_steps import (_DTYPES, _ForwardRuntime, _Runtime, _check_tensor, _inference_forward,
                                   _step_backward, _step_forward, _stream, _whole_shape)

# Zero each forward's saved parts before the forward writes them. Their
# bytes beside the values they hold (alignment, padding rows no step reads)
# are otherwise what torch's allocator handed over, so two runs of one
# forward return saved parts that differ there though every value the
# backward reads is the same: tools that compare an op's outputs bit for bit
# (torch.library.opcheck) need this on. It costs a memset of each part.
zero_saved = False


# The forward and the backward as torch.library custom ops, so that
# torch.compile traces a model holding moeforge layers without a graph break:
# each op's fake kernel says what it returns from shapes alone, and an op
# finds its module by a handle (an op's arguments are tensors and numbers).
_MODULES = {}  # handle -> weakref to the MoELayer


def _build_stamp():
    """The extension's file time, 40 bits of it: handles start there.
    A handle is a constant in a traced graph, so it is part of the key under
    which inductor caches the compiled graph on disk; the fake kernels' sizes
    (the saved parts') are not. A graph compiled by an earlier build whose
    layer laid out its memory differently would otherwise be reused and fail
    its size asserts."""
    try:
        return os.stat(mf._core.__file__).st_mtime_ns % (1 << 40)
    except (AttributeError, OSError):
        return 0


_HANDLES = itertools.count((_build_stamp() << 20) + 1)


def _module(handle):
    ref = _MODULES.get(handle)
    module = ref() if ref is not None else None
    if module is None:
        raise mf.UserError(f"moeforge: no live MoELayer has handle {handle} (the module was freed)")
    return module


@torch.library.custom_op("moeforge::layer_forward", mutates_args=())
def _layer_forward(handle: int, xs: list[torch.Tensor], params: list[torch.Tensor],
                   consts: list[torch.Tensor]) -> list[torch.Tensor]:
    outs, saved = _step_forward(_module(handle), xs, params, consts, zero_saved)
    return [*outs, *saved]


@_layer_forward.register_fake
def _(handle, xs, params, consts):
    module = _module(handle)
    x = xs[0]
    tokens = x.shape[0]
    outs = [x.new_empty(module._output_shape(f, tokens), dtype=dtype)
            for f, dtype in zip(module.outputs, module._output_dtypes)]
    if isinstance(tokens, int):  # the saved parts' bytes follow from the count
        part_bytes = module.saved_part_bytes(tokens) if tokens else [0]
    else:  # a symbolic count: the layer's sizes over the count, evaluated at it
        terms = module._saved_terms(tokens)
        # Else sizes known only when the op runs (unbacked sizes), around
        # which inductor splits the graph, and its CUDA graphs with it.
        part_bytes = ([_size_at(t, tokens) for t in terms] if terms is not None else
                      [torch.library.get_ctx().new_dynamic_size() for _ in range(module._saved_part_count())])
    return [*outs, *[x.new_empty(n, dtype=torch.uint8) for n in part_bytes]]


def _size_at(terms, tokens):
    """A layer's size over the token count (the layer's saved_terms():
    terms (align, [(bytes, [(a, b, d, m, c), ...]), ...])) at `tokens`, an
    int or torch.compile's symbolic count, with the same integer arithmetic
    as the layer's own size: the sum over terms of round_up(sum of bytes *
    prod((a T + b) // d * m + c), align)."""
    total = 0
    for align, products in terms:
        term = 0
        for nbytes, factors in products:
            product = nbytes
            for a, b, d, m, c in factors:
                product = product * ((a * tokens + b) // d * m + c)
            term = term + product
        total = total + (term + align - 1) // align * align
    return total


@torch.library.custom_op("moeforge::layer_backward", mutates_args=())
def _layer_backward(handle: int, xs: list[torch.Tensor], params: list[torch.Tensor], consts: list[torch.Tensor],
                    saved: list[torch.Tensor], read_outputs: list[torch.Tensor],
                    grads: list[torch.Tensor]) -> list[torch.Tensor]:
    return _step_backward(_module(handle), xs, params, consts, saved, read_outputs, grads)


@_layer_backward.register_fake
def _(handle, xs, params, consts, saved, read_outputs, grads):
    dtypes = _module(handle)._gradient_dtypes(xs[0].shape[0])
    return [t.new_empty(t.shape, dtype=dtype) for t, dtype in zip([*xs, *params], dtypes)]


def _setup_context(ctx, inputs, output):
    handle, xs, params, consts = inputs
    module = _module(handle)
    outs = output[:len(module.outputs)]
    saved = output[len(module.outputs):]
    x = xs[0]
    ctx.handle, ctx.input_count, ctx.param_count, ctx.const_count = handle, len(xs), len(params), len(consts)
    ctx.saved_count = len(saved)
    # An output without a gradient comes to the backward as None, not as
    # zeros: autograd would otherwise make a zero "gradient" of the saved
    # parts (uint8 tensors as large as the activations) in every backward,
    # beside the live one at the stack's peak, and write it (H100, fine64,
    # 8 layers: 754 MiB).
    ctx.set_materialize_grads(False)
    ctx.output_meta = [(o.shape, o.dtype) for o in outs]
    reads = module._backward_reads(x.shape[0])
    # Through save_for_backward, not ctx attributes: autograd frees the
    # saved parts when this node's backward ends (as attributes, every
    # layer's activations lived until the whole graph was dropped) and hands
    # it to saved-tensor hooks (torch.utils.checkpoint drops it and runs the
    # forward again). Of the outputs, only those the backward reads.
    ctx.save_for_backward(*saved, *xs, *params, *consts,
                          *[t for f, t in zip(module.outputs, outs) if f.name in reads])


def _backward(ctx, grads):
    tensors = ctx.saved_tensors
    saved, rest = list(tensors[:ctx.saved_count]), list(tensors[ctx.saved_count:])
    counts = (ctx.input_count, ctx.param_count, ctx.const_count)
    xs, params, consts = (rest[sum(counts[:i]):sum(counts[:i + 1])] for i in range(3))
    read = rest[sum(counts):]
    x = xs[0]
    # An output nothing used has no gradient: zeros of its shape.
    seeds = [g if g is not None else torch.zeros(shape, dtype=dtype, device=x.device)
             for g, (shape, dtype) in zip(grads, ctx.output_meta)]
    got = torch.ops.moeforge.layer_backward(ctx.handle, xs, params, consts, saved, read, seeds)
    cast = [g if g.dtype == t.dtype else g.to(t.dtype) for g, t in zip(got, [*xs, *params])]
    n = ctx.input_count
    return None, cast[:n], cast[n:], [None] * ctx.const_count  # constant inputs take no gradient


_layer_forward.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("moeforge::layer_inference", mutates_args=())
def _layer_inference(handle: int, xs: list[torch.Tensor], params: list[torch.Tensor],
                     consts: list[torch.Tensor]) -> list[torch.Tensor]:
    return _inference_forward(_module(handle), xs, params, consts)


@_layer_inference.register_fake
def _(handle, xs, params, consts):
    module = _module(handle)
    x = xs[0]
    return [x.new_empty(module._output_shape(f, x.shape[0]), dtype=dtype)
            for f, dtype in zip(module.outputs, module._output_dtypes)]


class MoELayer(torch.nn.Module):
    """A layer of the algebra as a module: its Params become nn.Parameters.

    pipeline: the layer (moeforge.Pipeline); outputs: the Funcs forward()
    returns (default: the pipeline's outputs, e.g. [y] or [y, lb_loss]);
    schedule: a moeforge.Schedule, a preset name, "default"
    (moeforge.default_schedule of this layer), or "auto" (the default:
    what `moeforge tune --train` or moeforge.tune(pipeline, tokens) cached
    for this layer, the first forward's token count and this GPU, else
    moeforge.default_schedule, the fastest
    hand-written schedule's choices made for this layer; schedule_note says
    which); keep_routing: keep a copy of each forward's routed experts
    (T * k int32 a route, on the device) for routed_experts(); init_scale: {param name:
    half-width of its uniform init} (default 1/sqrt(fan-in), the first
    non-expert dimension); device: where the parameters live and the layer
    runs: a GPU ('cuda', the CUDA backend) or 'cpu' (the LLVM CPU backend,
    on torch's CPU tensors in place: for development and tests, not speed);
    own_params: False for a layer of another module's weights, which
    registers no Parameters and reads the tensors each forward() is given
    (params=); inputs: the order of forward()'s arguments, by the names of
    the Inputs over the tokens (default: as the pipeline lists them);
    stored_in: {tensor name: {Param name: offset in elements}}: Params that
    live inside one tensor, read and written there in place (transformers'
    gate_up_proj [E, 2F, d] holds w1 and w3 [E, F, d], declared with
    outer_stride=2 F d, at offsets 0 and F d): that tensor, not its
    Params, is then the module's Parameter (or params= entry), of shape
    (n0, outer_stride / (n2 ...), n2, ...), and its gradient one tensor.

    Any number of forwards may be in flight (checkpointing, accumulation, a
    module applied twice); each serves one backward where the schedule has
    gradients_over_saved(true) (the default's: the backward writes the
    activation gradients over what its forward saved), so a second backward
    through one forward (retain_graph=True) is refused; a schedule with
    gradients_over_saved(False) keeps the saved activations for it.
    """

    def __init__(self, pipeline, outputs=None, schedule="auto", init_scale=None, device="cuda", dtype=None,
                 keep_routing=False, own_params=True, inputs=None, stored_in=None):
        super().__init__()
        input_order = inputs
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
        self._auto = isinstance(schedule, str) and schedule == "auto"
        if self._auto:
            self.schedule = mf.default_schedule(pipeline, self.outputs)
            self.schedule_note = "auto: the default schedule" + (
                " until the first forward looks in the tuned-schedule cache" if self.device.type == "cuda" else "")
        elif isinstance(schedule, str) and schedule == "default":
            self.schedule = mf.default_schedule(pipeline, self.outputs)
            self.schedule_note = "the default schedule"
        elif isinstance(schedule, str):
            if schedule not in mf.preset_names():
                raise mf.UserError(f"unknown schedule '{schedule}': choose 'auto' (the tuned cache's, else the "
                                   f"default), 'default', a preset ({', '.join(mf.preset_names())}) or a "
                                   "moeforge.Schedule (moeforge.Schedule.load(path) reads a file)")
            self.schedule = mf.preset(schedule)
            self.schedule_note = f"the schedule given ('{self.schedule.name}')"
        elif isinstance(schedule, mf.Schedule):
            self.schedule = schedule
            self.schedule_note = f"the schedule given ('{self.schedule.name}')"
        else:
            raise mf.UserError(f"schedule must be a moeforge.Schedule or a name ('auto', 'default', "
                               f"{', '.join(repr(n) for n in mf.preset_names())}), got {type(schedule).__name__}")
        # A choice the layer does not take would otherwise run as if absent, unseen.
        for note in mf.not_applied(pipeline, self.schedule, self.outputs):
            warnings.warn(f"moeforge: {note}", stacklevel=2)
        self._output_dtypes = self._stored_dtypes()
        decls = pipeline.buffer_decls
        inputs = [b for b in decls if b["kind"] == "input"]
        over_tokens = [b for b in inputs if None in tuple(b["shape"])]  # None: the token Dim
        if not over_tokens:
            raise mf.UserError(
                f"MoELayer takes a layer with an Input over the tokens (the argument of forward()); its Inputs "
                f"{[b['name'] for b in inputs]} have none")
        # forward()'s arguments: in the order `inputs` names them, else as
        # the layer lists them.
        if input_order is not None:
            names = [b["name"] for b in over_tokens]
            if sorted(input_order) != sorted(names):
                raise mf.UserError(f"inputs={list(input_order)} must name each Input over the tokens once: {names}")
            over_tokens = sorted(over_tokens, key=lambda b: list(input_order).index(b["name"]))
        self.input_names = [b["name"] for b in over_tokens]
        self.input_name = self.input_names[0]
        self._input_shapes = [tuple(b["shape"]) for b in over_tokens]
        for name, shape in zip(self.input_names, self._input_shapes):
            if len(shape) != 2 or shape[0] is not None or shape[1] is None:
                raise mf.UserError(f"MoELayer's Input '{name}' must be (tokens, width), declared {shape} "
                                   "(None: the token Dim)")
        self.own_params = own_params
        init_scale = init_scale or {}
        params = [b for b in decls if b["kind"] == "param"]
        for b in params:
            if any(s is None for s in b["shape"]):
                raise mf.UserError(f"Param '{b['name']}' has the token Dim: a weight cannot grow with the tokens")
        self._group_weights(params, stored_in or {})
        for name in self._weight_names:
            if not own_params:  # the caller's tensors, given to each forward
                continue
            b = next(b for b in params if b["name"] == self._members[name][0][0])
            shape = self._weight_shapes[name]
            declared = tuple(b["shape"])  # the (first) Param's own: its fan-in
            fan_in = declared[-2] if len(declared) >= 2 else declared[-1]
            scale = init_scale.get(name, init_scale.get(b["name"], 1.0 / math.sqrt(fan_in)))
            p = torch.empty(shape, dtype=dtype or _DTYPES[b["dtype"]], device=self.device)
            with torch.no_grad():
                p.uniform_(-scale, scale)
            self.register_parameter(name, torch.nn.Parameter(p))
        # Inputs not over the tokens (DeepSeek's selection-only expert bias):
        # buffers, read by every forward and given no gradient (the algebra
        # differentiates nothing through them); zeros until the model sets
        # them.
        self._const_names = []
        for b in inputs:
            if b["name"] in self.input_names:
                continue
            self.register_buffer(b["name"], torch.zeros(tuple(b["shape"]), dtype=_DTYPES[b["dtype"]],
                                                        device=self.device))
            self._const_names.append(b["name"])
        self._caller = None  # _Runtime, made at the first forward that records a backward
        # The forward alone: a _ForwardRuntime per distinct schedule its
        # token counts' buckets run (one, unless "auto" finds a schedule
        # tuned for some bucket: decoding's few tokens and a prefill's many
        # want different tiles), the bucket's, and the last one used.
        self._forward_runtimes = {}  # schedule text -> _ForwardRuntime
        self._forward_buckets = {}  # token bucket (a power of two) -> _ForwardRuntime
        self._forward_only = None  # _ForwardRuntime, made at the first forward that does not
        self._register()  # self._handle: how the custom ops find this module (_MODULES)
        self.keep_routing = keep_routing
        self._route_names = []
        self._routing = {}  # route -> the experts the last forward chose (int32, pair order)
        self._routing_tokens = None

    def _runtime(self, tokens):
        if self._caller is None:
            if self._auto and self.device.type == "cuda":  # the tuned-schedule cache, for this first count's bucket
                tuned, where = mf.cached_schedule(self.pipeline, tokens, True, self.device.index or 0)
                if tuned is not None:
                    self.schedule = tuned
                    self._output_dtypes = self._stored_dtypes()
                    self.schedule_note = f"auto: tuned for this layer and {tokens} tokens ({where})"
                else:
                    self.schedule_note = f"auto: the default schedule, nothing tuned for this layer here ({where})"
            self._caller = _Runtime(self, tokens)
            self._route_names = self._caller.layer.routes
        return self._caller

    def _forward_runtime(self, tokens):
        # A schedule given runs every count; under "auto" each power-of-two
        # bucket looks in the tuned cache once, as `moeforge tune` keys it.
        bucket = 1 << (tokens - 1).bit_length() if self._auto else 0
        rt = self._forward_buckets.get(bucket)
        if rt is None:
            schedule = self._forward_schedule(tokens)
            key = schedule.to_text()
            rt = self._forward_runtimes.get(key)
            if rt is None:  # compiled once per distinct schedule, serving every count of its buckets
                rt = self._forward_runtimes[key] = _ForwardRuntime(self, tokens, schedule)
            self._forward_buckets[bucket] = rt
        self._forward_only = rt
        self._route_names = rt.layer.routes
        return rt

    def _forward_schedule(self, tokens):
        """The schedule of a forward that records no backward: under "auto"
        what `moeforge tune` (forward) cached for this layer and GPU, else
        the layer's default forward schedule; otherwise the schedule given
        (its choices for the backward's Funcs left out)."""
        if not self._auto:
            return self.schedule
        if self.device.type == "cuda":
            tuned, _ = mf.cached_schedule(self.pipeline, tokens, False, self.device.index or 0)
            if tuned is not None:
                return tuned
        return mf.default_schedule(self.pipeline)

    def _stored_dtypes(self):
        """The torch dtype of each output, as the schedule stores it: bf16
        for y under bf16_boundary (the default's), whatever the Func's own
        dtype (f32, as sums are), so that every token count, 0 included,
        and both devices return one dtype."""
        return [_DTYPES[d] for d in mf.output_dtypes(self.pipeline, self.outputs, self.schedule)]

    def _record_routing(self, rt, device):
        """A copy of each route's experts, which live with the forward's
        saved memory (gone when its backward ends): T * k int32 a route."""
        self._routing = {}
        if not self.keep_routing:
            return
        for route in self._route_names:
            self._routing[route] = rt.routed_experts(route, device)

    def _output_shape(self, f, tokens):
        shape = []
        for v in f.args:
            d = v.dim
            if d.is_dynamic:
                shape.append(tokens)
            elif d.extent is not None:
                shape.append(d.extent)
            else:
                raise mf.UserError(f"output '{f.name}' is over {d.name}, not the tokens: a step of no tokens "
                                   "cannot shape it")
        return tuple(shape)

    def _no_token_output(self, f, dtype, device):
        if not any(v.dim.is_dynamic for v in f.args):
            raise mf.UserError(f"output '{f.name}' of a step of no tokens has no value (it reduces over the "
                               "tokens); skip the layer for an empty batch")
        return torch.zeros(self._output_shape(f, 0), dtype=dtype, device=device)

    def _register(self):
        """A handle of its own for the custom ops to find this module by:
        made when the module is, not while torch.compile traces it."""
        self._handle = next(_HANDLES)
        _MODULES[self._handle] = weakref.ref(self, lambda _, h=self._handle: _MODULES.pop(h, None))

    def __getstate__(self):
        # The compiled runtimes hold the backend's objects, which do not
        # copy: a copy compiles its own.
        state = self.__dict__.copy()
        state["_caller"] = state["_forward_only"] = None
        state["_forward_runtimes"], state["_forward_buckets"] = {}, {}
        state["_routing"] = {}
        return state

    def __setstate__(self, state):
        # A copy (copy.deepcopy, unpickling) is a module of its own: its own
        # handle and runtimes, compiled again at its first forward.
        super().__setstate__(state)
        self._caller = self._forward_only = None
        self._forward_runtimes, self._forward_buckets = {}, {}
        self._register()

    def _compiled(self, tokens):
        """The runtime, made at `tokens` (or one token for a symbolic count,
        as torch.compile's dynamic shapes trace)."""
        return self._runtime(tokens if isinstance(tokens, int) and tokens > 0 else 1)

    def _group_weights(self, params, stored_in):
        """The weight tensors the ops take (_weight_names, each a Param, or a
        tensor of `stored_in` holding several), their shapes, and each one's
        Params with their offsets in elements (_members)."""
        by_name = {b["name"]: b for b in params}
        self._weight_names, self._weight_shapes, self._members, self._covered = [], {}, {}, {}
        grouped = {}
        for whole, members in stored_in.items():
            if whole in by_name and whole not in members:
                raise mf.UserError(f"stored_in: '{whole}' is a Param of the layer; name the tensor otherwise")
            for p in members:
                if p not in by_name:
                    raise mf.UserError(f"stored_in['{whole}'] names '{p}', not a Param of this layer "
                                       f"({', '.join(by_name)})")
                if p in grouped:
                    raise mf.UserError(f"stored_in: Param '{p}' is in both '{grouped[p]}' and '{whole}'")
                grouped[p] = whole
        for b in params:
            name = b["name"]
            if name not in grouped:
                dense = math.prod(b["shape"][1:])
                if len(b["shape"]) >= 2 and b["outer_stride"] != dense:
                    raise mf.UserError(f"Param '{name}' is stored every {b['outer_stride']} elements along its first "
                                       f"dim, inside a larger tensor: name that tensor and where '{name}' lies in it "
                                       f"with stored_in={{'tensor': {{'{name}': offset, ...}}}}")
                self._weight_names.append(name)
                self._weight_shapes[name] = tuple(b["shape"])
                self._members[name] = [(name, 0)]
                self._covered[name] = True
                continue
            whole = grouped[name]
            if whole in self._members:
                continue
            self._weight_names.append(whole)
            self._members[whole] = [(p, int(offset)) for p, offset in stored_in[whole].items()]
            self._weight_shapes[whole], self._covered[whole] = _whole_shape(whole, [by_name[p] for p, _ in
                                                                                   self._members[whole]],
                                                                            self._members[whole])

    def _alone(self, weight):
        """Whether weight tensor `weight` is a Param of its own (not a tensor
        holding several)."""
        return self._members[weight] == [(weight, 0)]

    def _gradient_dtypes(self, tokens):
        """The gradients' dtypes, in the backward op's order: the token
        inputs', then each weight tensor's (its first Param's)."""
        layer = self._compiled(tokens).layer
        names = self.input_names + [self._members[w][0][0] for w in self._weight_names]
        return [_DTYPES[layer.info(layer.gradients[name])[0]] for name in names]

    def _backward_reads(self, tokens):
        return self._compiled(tokens).backward_reads

    def forward(self, *xs, params=None):
        """The layer's outputs for its Inputs over the tokens, in the order
        the layer declares them (input_names), each (tokens, width) or
        (..., width) with the same leading shape. params: {Param name:
        tensor} read in place of the module's own (every Param, for a
        module made with own_params=False): another module's weights, or
        views of them; gradients flow back to them as to any tensor."""
        if len(xs) != len(self.input_names):
            raise mf.UserError(f"forward() takes the layer's {len(self.input_names)} Input(s) over the tokens "
                               f"({', '.join(self.input_names)}), got {len(xs)}")
        lead = None
        flat = []
        for name, shape, x in zip(self.input_names, self._input_shapes, xs):
            _check_tensor(f"the input '{name}'", x, self.device)
            width = shape[1]
            if x.dim() < 2 or x.shape[-1] != width:
                raise mf.UserError(f"'{name}' has shape {tuple(x.shape)}; the layer expects (tokens, {width}) "
                                   f"or (..., {width}), e.g. (batch, seq, {width})")
            if lead is not None and tuple(x.shape[:-1]) != lead:
                raise mf.UserError(f"'{name}' has shape {tuple(x.shape)}, over other tokens than "
                                   f"'{self.input_names[0]}' {tuple(xs[0].shape)}: every input's leading shape "
                                   "must be the same")
            lead = tuple(x.shape[:-1])
            flat.append(x.reshape(-1, width))
        params = self._params(params)
        consts = [getattr(self, name) for name in self._const_names]
        for name, c in zip(self._const_names, consts):
            _check_tensor(f"the constant input '{name}'", c, self.device)
        needs_grad = any(x.requires_grad for x in xs) or any(p.requires_grad for p in params)
        if torch.is_grad_enabled() and needs_grad:
            outs = torch.ops.moeforge.layer_forward(self._handle, flat, params, consts)[:len(self.outputs)]
        else:  # no backward will run: the forward alone, keeping nothing
            outs = torch.ops.moeforge.layer_inference(self._handle, flat, params, consts)
        if len(lead) > 1:
            outs = [o.reshape(*lead, *o.shape[1:]) if o.dim() > 0 else o for o in outs]
        return tuple(outs) if len(outs) > 1 else outs[0]

    def _params(self, given):
        """The weights a forward reads, in the ops' order: the tensors given
        (checked: shape, device), else the module's own."""
        given = dict(given or {})
        names = ", ".join(self._weight_names)
        unknown = sorted(set(given) - set(self._weight_names))
        if unknown:
            raise mf.UserError(f"params names {unknown}, not weights of this layer ({names})")
        out = []
        for name in self._weight_names:
            if name not in given:
                if not self.own_params:
                    raise mf.UserError(f"this MoELayer holds no weights (own_params=False): forward() needs "
                                       f"params={{...}} with every weight ({names}); '{name}' is missing")
                out.append(getattr(self, name))
                continue
            t = given[name]
            _check_tensor(f"the weight '{name}'", t, self.device)
            if tuple(t.shape) != self._weight_shapes[name]:
                raise mf.UserError(f"the weight '{name}' given has shape {tuple(t.shape)}; the layer expects "
                                   f"{self._weight_shapes[name]}")
            out.append(t)
        return out

    def routed_experts(self, tokens=None, route="route"):
        """The experts the last forward chose (int32, pair order: token t's
        k experts at t * k ...); `tokens`, when given, must be its count."""
        if not self.keep_routing:
            raise mf.UserError("routed_experts: this module keeps no routing (it lives with each forward's saved "
                               "memory, gone when its backward ends); make it with keep_routing=True")
        if self._routing_tokens is None:
            raise mf.UserError("routed_experts: no forward has run yet")
        if tokens is not None and tokens != self._routing_tokens:
            raise mf.UserError(f"routed_experts({tokens}): the last forward ran {self._routing_tokens} tokens")
        if self._routing_tokens == 0:
            return torch.zeros(0, dtype=torch.int32)
        if route not in self._routing:
            raise mf.UserError(f"no route named '{route}' in this layer (it has {sorted(self._routing)})")
        return self._routing[route].cpu()

    def check_routing_scores(self):
        """Raises moeforge.UserError, naming the token and the expert, if a
        routing score of this module's work so far was NaN or infinite.
        On the CPU every forward refuses one at once. On the GPU the layer
        queues its work without waiting for it, so the routing reports such
        a score (its token's gates made NaN, its experts still in range)
        and the module's next forward or backward raises it; this waits
        for the current stream and raises it now."""
        if self.device.type != "cuda":
            return
        torch.cuda.current_stream(self.device).synchronize()
        for rt in (self._caller, *self._forward_runtimes.values()):
            if rt is not None:
                rt.layer.check_routing_scores(_stream(self.device))

    def _saved_terms(self, tokens):
        """saved_part_bytes over any token count (_size_at's terms, one
        list a part), for a symbolic count `tokens`; None where the layer has
        no such form, or no runtime yet and the count no hint to make it at."""
        if self._caller is None:
            hint = getattr(getattr(tokens, "node", None), "hint", None)
            if hint is None:
                return None
            self._runtime(int(hint))
        return self._caller.saved_terms()

    def saved_part_bytes(self, tokens):
        """What a forward over `tokens` tokens (at least 1) keeps for its
        backward, in bytes, as the tensors that hold it: each saved
        activation's, then the routing tables'."""
        return self._runtime(tokens).layer.step_memory(tokens)[0]

    def _saved_part_count(self):
        # The same at every count. Asked where a fake kernel has neither
        # sizes nor a count to make the runtime at (an unbacked count at the
        # first trace): the runtime is then made at one token, and under
        # "auto" takes what the tuned cache holds for that bucket.
        return len(self.saved_part_bytes(1))

    def saved_bytes(self, tokens):
        """What a forward over `tokens` tokens keeps for its backward
        (activations and routing tables), in bytes."""
        return sum(self.saved_part_bytes(tokens)) if tokens else 0


def example(name, experts=8, topk=2, d=64, f=128, schedule="auto", device="cuda", **kwargs):
    """A ready-made layer (moeforge.example_names()) as a MoELayer."""
    ex, _ = mf.make_example(name, tokens=1, experts=experts, topk=topk, d=d, f=f)
    return MoELayer(ex.pipeline, schedule=schedule, init_scale=dict(ex.init_scale), device=device, **kwargs)
