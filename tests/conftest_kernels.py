"""Running the Triton kernels on a CPU-only machine, through Triton's interpreter.

Triton picks interpreted vs compiled once per ``@triton.jit`` function, when the function is
*defined*, by reading ``TRITON_INTERPRET``. Setting the variable at the top of a test module is
not always early enough: ``tests/conftest.py`` imports transformers, which imports torch._dynamo,
which imports triton, so triton's own jit helpers (``tl.zeros``, ``tl.max``, ``tl.sum``, ...) may
already exist in compiled form, and the interpreter refuses to call them ("Cannot call
@triton.jit'd outside of the scope of a kernel"). ``use_interpreter_without_cuda`` sets the
variable and re-wraps whatever was defined too early.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch


def use_interpreter_without_cuda() -> bool:
    """Switch Triton to its CPU interpreter when there is no CUDA device; return whether it is on.

    Call before importing any ``kernels.*_triton`` module. Kernels run natively on CUDA, and an
    explicit ``TRITON_INTERPRET=0`` from the environment is respected.
    """
    if torch.cuda.is_available():
        return os.environ.get("TRITON_INTERPRET", "0") == "1"
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] != "1":
        return False
    _reinterpret_loaded_triton()
    return True


def _reinterpret_loaded_triton() -> None:
    """Re-wrap jit functions that were defined before ``TRITON_INTERPRET`` was set."""
    if "triton" not in sys.modules:
        return  # nothing defined yet: the environment variable is enough
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    # One wrapper per original, so aliases (tl.max is tl.standard.max) stay identical objects: the
    # interpreter recognises its fast reductions by the identity of their combine functions.
    wrapped: dict[int, InterpretedFunction] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("triton.language"):
            continue
        for attr, obj in list(vars(module).items()):
            if isinstance(obj, JITFunction):
                setattr(module, attr, wrapped.setdefault(id(obj), InterpretedFunction(obj.fn)))
    # Our own kernel modules, if something imported them early, get re-defined in interpreted form.
    for name in [n for n in sys.modules if n.startswith("kernels.") and n.endswith("_triton")]:
        importlib.reload(sys.modules[name])
