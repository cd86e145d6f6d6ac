"""Counts, over one training step on CPU, the calls that would make the host wait for the GPU on CUDA.

On a GPU the host runs ahead of the device until it needs a value the device has not computed yet: `.item()`,
`.tolist()`, `int()`/`float()`/`bool()` of a tensor, `.numpy()`, `.cpu()`, ops whose output size depends on the
data (`nonzero`, boolean-mask indexing, `unique`, ...), `torch.equal`, and a host-to-device copy that is not
`non_blocking` (from pageable memory CUDA synchronises the stream before it copies). On CPU every tensor lives on the
one device, so the probe keeps its own account of which tensors would be on the GPU (a `TorchFunctionMode` over the
step sees every Python-level torch call, with its arguments as the caller wrote them):

- host: tensors made by a torch call from host tensors only; by a factory call with no `device=` or with the
  string "cpu" (as torch.optim makes its step counters; a `torch.device` object, such as `accelerator.device` or
  `x.device`, counts as the device); by `.cpu()` or `.to("cpu")`; and the data object's own tensors
  (`TrainingData`/`PreferenceData`: rows, token counts, precomputed reference log-probs). The mode follows the run
  from the start of step 1, so what the first step makes (the optimizer's state, the epoch's row order) is
  classified by these rules; it records only inside the probed step.
- device: everything else, conservatively: `.to(device)` of anything, a factory call given a device object, any
  result of a call with a device tensor among its inputs, and every tensor the probe did not see being made
  (parameters, gradients written by autograd, engine buffers, collective outputs).

Every syncing call on a device tensor is recorded with the first caller outside torch (file:line function), and so
is every copy to a device that is not `non_blocking` from a host tensor. What the probe cannot see: syncs inside a
C++ kernel, and whether a host tensor is pinned (pinning needs CUDA; `zero_utils.run.transfer.to_device` pins when
the device is CUDA, which `benchmarks/gpu.py` checks with `torch.cuda.set_sync_debug_mode`).
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

# Calls that return a host value computed on the device, or whose output size depends on device data.
_SYNCING = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__", "__complex__", "numpy", "__array__",
            "cpu", "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose",
            "is_nonzero"}
_FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "range", "linspace", "logspace",
              "rand", "randn", "randint", "randperm", "eye", "zeros_like", "ones_like", "empty_like", "full_like",
              "rand_like", "randn_like", "randint_like", "scalar_tensor", "from_numpy", "frombuffer", "empty_strided"}
_TORCH_DIR = str(Path(torch.__file__).parent)
_REPO = str(Path(__file__).resolve().parents[2]) + "/"
KERNEL_STAND_INS = ("tests/scripts/varlen_probe.py",)  # flash-attn's kernels on CPU: what they read is not ours


def _caller() -> str:
    """The first frame outside torch and this file, as `path:line function` (path from site-packages or the repo)."""
    frame = sys._getframe(2)
    while frame and (frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{_short(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}"


def _short(path: str) -> str:
    """A source path from site-packages or from the repository root."""
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1]
    return path[len(_REPO):] if path.startswith(_REPO) else path


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


class SyncProbe(TorchFunctionMode):
    """The mode over one step: `syncs` lists {"call", "where"} of each syncing call on a device tensor (blocking
    host-to-device copies as call "to (blocking host-to-device)"); `copies` counts the host-to-device copies."""

    def __init__(self, host_tensors):
        super().__init__()
        self.host: dict[int, weakref.ref] = {}  # by id, checked by identity (tensors compare element-wise)
        for tensor in host_tensors:
            self._mark_host(tensor)
        self.recording = False  # syncs and copies are recorded only in the probed step
        self.syncs: list[dict] = []
        self.copies = {"non_blocking": 0, "blocking": 0}

    def _mark_host(self, tensor: torch.Tensor) -> None:
        self.host[id(tensor)] = weakref.ref(tensor)

    def _on_device(self, tensor: torch.Tensor) -> bool:
        ref = self.host.get(id(tensor))
        return ref is None or ref() is not tensor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = _tensors((args, kwargs))
        on_device = any(self._on_device(t) for t in inputs)
        target = _target_device(args[1:], kwargs) if name == "to" else None
        moves = name == "cuda" or (target is not None and target != "cpu")  # to the device ("cpu": to the host)
        if self.recording:
            self._record(name if target != "cpu" else "cpu", args, kwargs, on_device, moves)
        out = func(*args, **kwargs)
        to_host = name == "cpu" or target == "cpu"
        if to_host or (name in _FACTORIES and not inputs and kwargs.get("device") in (None, "cpu")) or \
                (inputs and not on_device and not moves):
            for tensor in _tensors(out):
                self._mark_host(tensor)
        elif moves and isinstance(out, torch.Tensor):  # on CPU `.to(device)` returns the host tensor itself
            self.host.pop(id(out), None)
        return out

    def _record(self, name, args, kwargs, on_device, moves):
        if _caller().startswith(KERNEL_STAND_INS):  # a plain-PyTorch stand-in for a C++ kernel
            return
        if name in _SYNCING and on_device:
            self.syncs.append({"call": name, "where": _caller()})
        if name == "__getitem__" and on_device and any(t.dtype == torch.bool for t in _tensors(args[1:])):
            self.syncs.append({"call": "boolean-mask indexing", "where": _caller()})
        if name == "repeat_interleave" and on_device and "output_size" not in kwargs and \
                any(isinstance(r, torch.Tensor) for r in args[1:2]):
            self.syncs.append({"call": "repeat_interleave without output_size", "where": _caller()})
        if moves and not on_device:
            blocking = not (kwargs.get("non_blocking") or (len(args) > 2 and args[2] is True))
            self.copies["blocking" if blocking else "non_blocking"] += 1
            if blocking:
                self.syncs.append({"call": "to (blocking host-to-device)", "where": _caller()})


def _target_device(args, kwargs):
    """The device a `Tensor.to(...)` call names, or None when it changes only the dtype."""
    if kwargs.get("device") is not None:
        return kwargs["device"]
    for arg in args:
        if isinstance(arg, (str, torch.device)):
            return arg
    return None


def data_tensors(data) -> list[torch.Tensor]:
    """The data object's tensors (walked through its attributes, dicts and lists): rows, token counts, precomputed
    reference log-probs, which sit on the host on a GPU machine too."""
    found, seen = [], set()

    def walk(obj, depth):
        if id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, dict):
            for value in obj.values():
                walk(value, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                walk(value, depth + 1)

    walk(vars(data), 0)
    return found


_state: dict = {"starts": 0, "probe": None, "result": None}


def start_step(step: int, data) -> None:
    """At each `RunMeasurements.start_step`: the mode follows the tensors from the first step on (so that what
    step 1 made, the optimizer's state and the epoch's row order among it, is classified), records from the start
    of step `step` and closes at the start of the step after it."""
    _state["starts"] += 1
    if _state["starts"] == 1:
        _state["probe"] = SyncProbe(data_tensors(data))
        _state["probe"].__enter__()
    if _state["probe"] is not None:
        _state["probe"].recording = _state["starts"] == step
        if _state["starts"] == step + 1:
            stop(complete=True)


def stop(complete: bool = False) -> None:
    """Close the window if it is open: `complete` when the next step starts, not when the run ends inside it."""
    probe = _state["probe"]
    if probe is not None:
        probe.__exit__(None, None, None)
        _state["probe"], _state["result"] = None, {"syncs": probe.syncs, "host_to_device_copies": probe.copies,
                                                   "complete": complete}


def result():
    """{"syncs": [...], "host_to_device_copies": {...}, "complete": bool} of the probed step (incomplete: the run
    ended inside it, so the window also held the end of the run), or None if it never opened."""
    return _state["result"]


_cuda: dict = {"starts": 0, "catcher": None, "records": None, "result": None}


def cuda_start_step(step: int) -> None:
    """On a GPU, at each `RunMeasurements.start_step`: what CUDA itself reports as synchronising during step `step`
    (`torch.cuda.set_sync_debug_mode("warn")` from its start to the next step's), each warning with the Python line
    that raised it. Cheap: the mode is on for that one step only, with no Python-level tracking."""
    import warnings

    _cuda["starts"] += 1
    if _cuda["starts"] == step + 1:
        cuda_stop(complete=True)
    if _cuda["starts"] == step and torch.cuda.is_available():
        _cuda["catcher"] = warnings.catch_warnings(record=True)
        _cuda["records"] = _cuda["catcher"].__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")


def cuda_stop(complete: bool = False) -> None:
    """Close the CUDA window if it is open (`complete` as in `stop`)."""
    if _cuda["catcher"] is None:
        return
    torch.cuda.set_sync_debug_mode("default")
    _cuda["catcher"].__exit__(None, None, None)
    syncs = [{"message": str(w.message).splitlines()[0][:160], "where": f"{_short(w.filename)}:{w.lineno}"}
             for w in _cuda["records"] if "synchroniz" in str(w.message)]
    _cuda["catcher"], _cuda["result"] = None, {"syncs": syncs, "complete": complete}


def cuda_result():
    """{"syncs": [{"message", "where"}], "complete": bool} of the probed step on a GPU, or None."""
    return _cuda["result"]
