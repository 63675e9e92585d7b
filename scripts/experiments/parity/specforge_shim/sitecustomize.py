"""Run SpecForge 0.2.0's EAGLE-3 trainer on a CPU-only machine, without editing the installed package.

Put this folder on PYTHONPATH (scripts/experiments/parity/reference.py does): Python imports ``sitecustomize`` at start-up, in
the trainer's spawned worker too. Two runtime patches (see scripts/experiments/parity/reference_trainers_on_cpu.md):
  1. ``specforge/core/loss.py`` imports ``triton`` at module level, and torch's CPU wheel has no Triton. While that
     one module executes, ``triton`` is a stub whose ``jit`` returns the function unchanged, so its kernels are
     defined and never launched.
  2. EAGLE-3's loss calls ``LogSoftmaxLoss.apply`` (those Triton kernels) unconditionally. It is pointed at
     ``_compute_loss``, the eager reference in the same file: the same soft cross-entropy, ``-sum(mask * p * log
     softmax(logits)).mean()``.
Run with TORCH_COMPILE_DISABLE=1 (``_compute_loss`` is wrapped in torch.compile, which would want a C++ toolchain
and Triton's absence checked). On a machine with CUDA nothing is patched.
"""

import importlib.abc
import importlib.machinery
import sys
import types

import torch

LOSS_MODULE = "specforge.core.loss"


class _AnyAttribute(types.ModuleType):
    """A stand-in for triton and triton.language: decorators return their function, anything else is a dummy."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _identity_decorator if name in ("jit", "autotune", "heuristics") else object


def _identity_decorator(fn=None, **_):
    return fn if fn is not None else (lambda f: f)


class _StubbedLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        # the module's torch.compile decorator loads dynamo and inductor, which probe the real triton: load them
        # first, while the stub is not in place
        torch.compile(lambda x: x)
        stubs = {"triton": _AnyAttribute("triton"), "triton.language": _AnyAttribute("triton.language")}
        stubs["triton"].language = stubs["triton.language"]
        sys.modules.update(stubs)
        try:
            self.loader.exec_module(module)
        finally:
            for name in stubs:
                sys.modules.pop(name, None)
        reference = module._compute_loss
        module.LogSoftmaxLoss.apply = staticmethod(lambda logits, target, mask: reference(logits, target, mask))


class _LossFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != LOSS_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            spec.loader = _StubbedLoader(spec.loader)
        return spec


if not torch.cuda.is_available():
    sys.meta_path.insert(0, _LossFinder())
