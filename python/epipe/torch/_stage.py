"""PipelineStage: one pipeline stage's module, its place in the pipeline, and
the codecs of the boundaries it sends across."""
import torch


class PipelineStage:
    """Module `module` as pipeline stage `stage_index` of `num_stages`.

    comm: the epipe.Comm its rank runs on (epipe.Comm.from_env() when None,
    as torchrun or epipe-run start it). act_codec / grad_codec: codec specs
    for the activations this stage sends and the gradients it sends back
    (None: the schedule's, "none" by default). device: where the module's
    parameters and buffers live (move the module there first: a parameter
    elsewhere is refused here, as is "cuda" where torch sees no such
    device), and where the tensors it computes live. On "cuda" the boundary
    tensors stay on the GPU: the codecs encode what the stage sends on the
    GPU, only the payload crosses to the host for the transport, and what
    it receives is decoded into GPU memory the stage lends.
    """

    def __init__(self, module, stage_index, num_stages, device="cpu", *, comm=None,
                 act_codec=None, grad_codec=None):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"PipelineStage: module must be a torch.nn.Module, not "
                            f"{type(module).__name__}")
        if not 0 <= int(stage_index) < int(num_stages):
            raise ValueError(f"PipelineStage: stage_index {stage_index} is out of range "
                             f"0..{int(num_stages) - 1} (num_stages {num_stages})")
        self.submod = module
        self.stage_index = int(stage_index)
        self.num_stages = int(num_stages)
        self.device = _stage_device(device, self.stage_index)
        _check_module_device(module, self.device, self.stage_index)
        self.comm = comm
        self.act_codec = act_codec
        self.grad_codec = grad_codec

    @property
    def is_first(self):
        return self.stage_index == 0

    @property
    def is_last(self):
        return self.stage_index == self.num_stages - 1

    def __repr__(self):
        return f"PipelineStage({self.stage_index} of {self.num_stages}, {self.device})"


def _stage_device(device, index):
    """torch.device(device), with a CUDA one checked and given its index."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"PipelineStage {index}: device {device!r} is not a device: {e}") from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"PipelineStage {index}: device {str(d)!r}, but torch sees no CUDA "
                               "device (torch.cuda.is_available() is False)")
        count = torch.cuda.device_count()
        if d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
        elif d.index >= count:
            raise ValueError(f"PipelineStage {index}: device {str(d)!r}, but torch sees {count} "
                             f"CUDA device{'s' if count != 1 else ''}")
    return d


def _check_module_device(module, device, index):
    for kind, named in (("parameter", module.named_parameters()),
                        ("buffer", module.named_buffers())):
        for name, t in named:
            if t.device != device:
                raise ValueError(f"PipelineStage {index}: the module's {kind} {name!r} is on "
                                 f"{t.device}, not the stage's device {device}; move the module "
                                 f"there first (module.to({str(device)!r}))")
