"""Schedules with step(): one training step of a pipeline stage's rank,
driven through the stage's op stream with torch autograd."""
import torch

from .. import _core as core


class PipelineSchedule:
    """The schedule `kind` over the PipelineStage(s) this rank holds.

    stages: one PipelineStage, or a list of them for the schedules with
    several model chunks per rank (interleaved: stage r, r+p, ...; zb-v:
    stage r and 2p-1-r). n_microbatches: micro-batches a step (the batch is
    cut along dimension 0). loss_fn(output, target): on the last stage,
    called per micro-batch; its value is appended to step()'s `losses` and
    its gradient scaled by 1/n_microbatches, so a mean-reduced loss gives the
    gradient of the whole batch's mean, as one process would. Gradients
    accumulate in .grad, as torch does: zero them and step the optimizer
    yourself. Every rank must build the same schedule (kind, micro-batches,
    codecs); a rank that does not is refused at the first message.
    batch_size: rows a step, for the stage's shape checks and samples/s;
    the first and last stages learn it from step()'s tensors, a middle
    stage counts no samples unless told. stream_ordered (stages on CUDA):
    sends and receives return with their codec work queued on torch's
    current stream instead of waiting for it (EPIPE_STAGE_CUDA_STREAM_ORDERED
    in epipe/stage.h); what the GPU finds wrong is then raised by the call
    that ends the step, which waits once a step. Use the stage's tensors on
    torch's current stream, as autograd does.
    """

    kind = None

    def __init__(self, stages, n_microbatches, loss_fn=None, *, batch_size=None,
                 timeout_ms=None, stream_ordered=False):
        self.stages = list(stages) if isinstance(stages, (list, tuple)) else [stages]
        if not self.stages:
            raise ValueError(f"{type(self).__name__}: no stage given")
        num = {s.num_stages for s in self.stages}
        if len(num) != 1:
            raise ValueError(f"{type(self).__name__}: the stages disagree on num_stages: "
                             f"{sorted(num)}")
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or \
                not 1 <= n_microbatches <= 65536:
            raise ValueError(f"{type(self).__name__}: n_microbatches must be an int in 1..65536, "
                             f"not {n_microbatches!r}")
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self._broken = None  # why a step failed: the op stream cannot be resumed
        self._in_ops = False
        first = self.stages[0]
        self.comm = first.comm if first.comm is not None else core.Comm.from_env()
        chunks = len(self.stages)
        self._stage = core.Stage(self.comm, self.kind, self.n_microbatches,
                                 chunks=chunks if chunks > 1 or self.kind == "zb-v" else None,
                                 batch_size=batch_size, timeout_ms=timeout_ms)
        self._batch = batch_size
        try:
            self._place()
            self._codecs(first)
            if first.device.type == "cuda":
                # received tensors come decoded in this GPU's memory
                index = first.device.index
                self._stage.set_param(core.STAGE_CUDA_DEVICE,
                                      torch.cuda.current_device() if index is None else index)
                if stream_ordered:
                    self._stage.set_param(core.STAGE_CUDA_STREAM_ORDERED, 1)
        except Exception:
            self._stage.close()
            raise

    def _place(self):
        """Matches the epipe stage's chunks with the PipelineStages given."""
        by_index = {s.stage_index: s for s in self.stages}
        self._chunks = []
        for k in range(self._stage.chunks):
            g, total = self._stage.chunk_stage(k)
            if total != self.stages[0].num_stages:
                raise ValueError(f"{type(self).__name__}: the schedule has {total} pipeline "
                                 f"stages over {self.comm.size} ranks; the stages say "
                                 f"{self.stages[0].num_stages}")
            if g not in by_index:
                raise ValueError(f"{type(self).__name__}: rank {self.comm.rank} runs pipeline "
                                 f"stage {g} here, but was given stages "
                                 f"{sorted(by_index)}")
            self._chunks.append(by_index[g])
        if len(self._chunks) != len(self.stages):
            raise ValueError(f"{type(self).__name__}: {len(self.stages)} stages given; this "
                             f"rank holds {len(self._chunks)}")

    def _codecs(self, s):
        for direction, spec in ((core.ACTIVATION, s.act_codec), (core.GRADIENT, s.grad_codec)):
            if spec is None:
                continue
            if isinstance(spec, dict):  # per boundary
                for b, one in spec.items():
                    self._stage.set_codec(direction, one, boundary=int(b))
            else:
                self._stage.set_codec(direction, spec)

    # -- helpers
    def _learn_batch(self, *tensors):
        """The batch size for the stage's checks and samples/s: given, or
        the inputs' (first stage) or the target's (last stage); a middle
        stage that is not told counts no samples."""
        for t in tensors:
            if t is not None and t.dim() and t.shape[0] != self._batch:
                self._batch = int(t.shape[0])
                self._stage.set_param(core.STAGE_BATCH_SIZE, self._batch)
                return

    def _split(self, tensor):
        parts = torch.tensor_split(tensor, self.n_microbatches)
        if any(p.shape[0] == 0 for p in parts):
            raise ValueError(f"{type(self).__name__}: a batch of {tensor.shape[0]} cannot be "
                             f"cut into {self.n_microbatches} micro-batches")
        return parts

    @staticmethod
    def _to_host(t):
        """What the C stage sends: the tensor itself (CPU, or CUDA and dense:
        the codecs encode it on its GPU)."""
        t = t.detach()
        return t if t.device.type == "cpu" else t.contiguous()

    def _recv_act(self, ps, mb, copy):
        x = self._stage.recv_activation(mb, copy=copy or ps.device.type not in ("cpu", "cuda"))
        return x.to(ps.device).requires_grad_(torch.is_grad_enabled())

    def _recv_grad(self, ps, mb, copy):
        return self._stage.recv_gradient(
            mb, copy=copy or ps.device.type not in ("cpu", "cuda")).to(ps.device)

    @staticmethod
    def _output(ps, out):
        """out, checked: a stage hands one tensor to the next (or to the
        loss); anything else would fail later with a message about
        something else."""
        if not isinstance(out, torch.Tensor):
            what = "None" if out is None else f"a {type(out).__name__}"
            raise TypeError(f"PipelineStage {ps.stage_index}: its module returned {what}; a "
                            f"pipeline stage must return one tensor")
        return out

    @classmethod
    def _forward(cls, ps, x, split_weights):
        """ps's forward on x: (output, taps). For the schedules that defer
        the weight gradients, taps lists (output, parameters) of each child
        of an nn.Sequential that has trainable parameters, so that the
        weight op can start at each layer's output: a single backward from
        the stage's output to every parameter would compute each later
        layer's input gradient again (on a chain of linear layers, half the
        backward again). None otherwise (another module, or one with hooks,
        whose children cannot be run one by one, or a child with parameters
        that returns a tuple)."""
        mod = ps.submod
        if (not split_weights or ps.is_first or not isinstance(mod, torch.nn.Sequential)
                or mod._forward_hooks or mod._forward_pre_hooks or mod._backward_hooks
                or getattr(mod, "_backward_pre_hooks", None)
                or not torch.is_grad_enabled()):
            return cls._output(ps, mod(x)), None
        taps, h = [], x
        for child in mod:
            h = child(h)
            params = [p for p in child.parameters() if p.requires_grad]
            if not params or taps is None:
                continue
            if not isinstance(h, torch.Tensor):
                taps = None  # a tuple out: the weight op starts at the stage's output
            elif h.requires_grad:
                taps.append((h, params))
        return cls._output(ps, h), taps

    # -- the step
    def _guarded(self, run, *args, **kwargs):
        """run(...) for step() or eval(). An exception in the middle of a
        step (the host's module, its loss, a peer) leaves the op stream part
        way through the schedule, where no later step can pick it up: the
        communicator is aborted so the peers stop at once instead of waiting
        out their timeout (as a failing callback does in C), and every later
        call says why."""
        if self._broken is not None:
            raise RuntimeError(f"{type(self).__name__}: an earlier step failed ({self._broken}); "
                               "its pipeline cannot go on: make new stages and a new schedule")
        self._in_ops = False  # set once the op stream has given an op
        try:
            return run(*args, **kwargs)
        except BaseException as e:
            if self._in_ops:  # a refusal of the arguments before that costs nothing
                self._broken = f"{type(e).__name__}: {e}"
                self.comm.abort()
            raise

    def step(self, *args, target=None, losses=None):
        """One training step (under torch.no_grad(): a forward-only one, as
        eval()). The first stage's rank passes the batch's inputs, the last
        stage's the target; other ranks pass nothing. Returns the last
        stage's output (the micro-batches' outputs concatenated) on its rank,
        None elsewhere. If it raises, the schedule is done (see _guarded)."""
        if not torch.is_grad_enabled():
            return self.eval(*args, target=target, losses=losses)
        return self._guarded(self._step, *args, target=target, losses=losses)

    def _step(self, *args, target=None, losses=None):
        st, m = self._stage, self.n_microbatches
        xs = self._split(args[0]) if any(c.is_first for c in self._chunks) else None
        holds_last = any(c.is_last for c in self._chunks)
        if holds_last and (self.loss_fn is None or target is None):
            raise ValueError(f"{type(self).__name__}.step: the last stage needs loss_fn and "
                             f"target to train (use eval() to run forwards only)")
        ts = self._split(target) if holds_last else None
        self._learn_batch(args[0] if xs is not None else None, target if holds_last else None)
        outputs, saved = [None] * m, {}
        split_weights = self.kind in ("zb-h1", "zb-v")
        self._in_ops = True
        for op in st.ops():
            mb, ps = op.microbatch, self._chunks[op.chunk]
            key = (op.chunk, mb)
            if op.kind == core.OP_FORWARD:
                x = xs[mb].to(ps.device) if ps.is_first else self._recv_act(ps, mb, False)
                out, taps = self._forward(ps, x, split_weights)
                if ps.is_last:
                    outputs[mb] = out.detach()
                    loss = self.loss_fn(out, ts[mb].to(ps.device))
                    if losses is not None:
                        losses.append(loss.detach())
                    out = loss / m
                else:
                    st.send_activation(mb, self._to_host(out))
                saved[key] = (x, out, taps)
            elif op.kind == core.OP_BACKWARD:
                x, out, _ = saved.pop(key)
                g = None if ps.is_last else self._recv_grad(ps, mb, False)
                torch.autograd.backward(out, g)
                if not ps.is_first:
                    st.send_gradient(mb, self._to_host(x.grad))
            elif op.kind == core.OP_BACKWARD_INPUT:
                x, out, taps = saved[key]
                # the received gradient is lent until the next op: W needs a copy
                g = None if ps.is_last else self._recv_grad(ps, mb, True)
                weights = [(out, g, None)]  # W: from the output, every parameter
                if not ps.is_first:
                    if taps:
                        # the same backward pass yields the gradient at each
                        # layer's output: W starts there, and computes no
                        # input gradient a second time
                        got = torch.autograd.grad(out, [x] + [t for t, _ in taps], g,
                                                  retain_graph=True, allow_unused=True)
                        gx = got[0]
                        weights = [(t, gt, params)
                                   for (t, params), gt in zip(taps, got[1:]) if gt is not None]
                    else:
                        gx, = torch.autograd.grad(out, x, g, retain_graph=True)
                    st.send_gradient(mb, self._to_host(gx))
                saved[key] = weights
            elif op.kind == core.OP_BACKWARD_WEIGHT:
                for t, gt, params in saved.pop(key):
                    if params is None:
                        params = [p for p in ps.submod.parameters() if p.requires_grad]
                    if params:
                        torch.autograd.backward(t, gt, inputs=params)
            else:
                raise RuntimeError(f"{type(self).__name__}: unknown op kind {op.kind}")
        return torch.cat(outputs) if holds_last else None

    @torch.no_grad()
    def eval(self, *args, target=None, losses=None):
        """A forward-only step (evaluation): no gradient crosses. Returns the
        last stage's output on its rank (and appends loss_fn's values to
        `losses` when target is given), None elsewhere. If it raises, the
        schedule is done, as after step()."""
        return self._guarded(self._eval, *args, target=target, losses=losses)

    def _eval(self, *args, target=None, losses=None):
        st, m = self._stage, self.n_microbatches
        xs = self._split(args[0]) if any(c.is_first for c in self._chunks) else None
        holds_last = any(c.is_last for c in self._chunks)
        ts = self._split(target) if holds_last and target is not None else None
        outputs = [None] * m
        st.training = False
        st.set_param(core.STAGE_BATCH_SIZE, 0)  # evaluation batches have their own size
        self._in_ops = True
        try:
            for op in st.ops():
                mb, ps = op.microbatch, self._chunks[op.chunk]
                x = xs[mb].to(ps.device) if ps.is_first else self._recv_act(ps, mb, False)
                out = self._output(ps, ps.submod(x))
                if ps.is_last:
                    outputs[mb] = out
                    if ts is not None and losses is not None and self.loss_fn is not None:
                        losses.append(self.loss_fn(out, ts[mb].to(ps.device)))
                else:
                    st.send_activation(mb, self._to_host(out))
        finally:
            st.training = True
            st.set_param(core.STAGE_BATCH_SIZE, self._batch or 0)
        return torch.cat(outputs) if holds_last else None

    def stats(self):
        """The stage's statistics (epipe.Stage.stats()) and its boundaries'."""
        s = self._stage.stats()
        s["boundary_stats"] = self._stage.boundary_stats()
        return s

    def close(self):
        self._stage.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ScheduleGPipe(PipelineSchedule):
    """GPipe: every forward, then every backward."""
    kind = "gpipe"


class Schedule1F1B(PipelineSchedule):
    """1F1B (PipeDream-flush): at most p-s micro-batches alive on stage s."""
    kind = "1f1b"


class ScheduleInterleaved1F1B(PipelineSchedule):
    """Megatron's interleaved 1F1B: each rank holds several model chunks
    (a list of PipelineStages, round-robin: stage r, r+p, ...)."""
    kind = "interleaved"


class ScheduleZBH1(PipelineSchedule):
    """Zero-bubble H1: the backward split into the input gradient (sent at
    once, torch.autograd.grad) and the weight gradient (deferred)."""
    kind = "zb-h1"


class ScheduleZBV(PipelineSchedule):
    """Zero-bubble V: two chunks per rank in a V (stage r and 2p-1-r)."""
    kind = "zb-v"
