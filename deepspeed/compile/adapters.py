# SPDX-License-Identifier: Apache-2.0
"""Every method or attribute the package rebinds on an object it does not own, one small adapter per object.

[Note: rebinding] While DeepCompile runs an engine, some objects of torch and DeepSpeed behave differently: a
module's ``forward``, a module's ``compile`` and compiled call, a ZeRO-1/2 optimizer's bucket reduction, a ZeRO-3
parameter's ``.data``. Each is changed on the instance only (never on its class: other engines and other code see
the class as it is), only through the adapter below, and put back when the engine leaves DeepCompile. Each adapter
says why and which upstream release it was written against, and declares in ``TARGET`` what it relies on: the
attributes and parameters ``compat.check`` verifies at activation, so that an upgrade fails there with one clear
error, not deep inside a step. (Effects on the whole process, not on an engine's objects: ``effects.py``.)
"""
from typing import Callable, Optional

from torch import Tensor, nn

ALL, Z12, Z3 = (0, 1, 2, 3), (1, 2), (3, )


class ModuleForward:
    """``module.forward`` set on the instance, which ``nn.Module._call_impl`` calls in place of the class's method:
    the compiled blocks' trampolines and leaf regions (``driver/regions.py``), and modules that gather a parameter
    they return for a caller run as Python (``runtime/eager_access.py``). Each installer marks its functions
    (``mark``) and removes only those: a ``forward`` someone else set (Accelerate's hooks) is left alone. Written
    against torch 2.13."""
    TARGET = ("torch.nn", "Module", {"forward": None, "_call_impl": None}, ALL)

    @staticmethod
    def own(module: nn.Module) -> Optional[Callable]:
        """The ``forward`` set on the instance, if any."""
        return module.__dict__.get("forward")

    @staticmethod
    def set(module: nn.Module, forward: Callable) -> None:
        module.forward = forward

    @staticmethod
    def clear(module: nn.Module, installed: Callable[[Callable], bool]) -> None:
        """The class's ``forward`` back, where the instance's is one ``installed`` recognises."""
        forward = module.__dict__.get("forward")
        if forward is not None and installed(forward):
            del module.forward


class ModuleCompile:
    """``nn.Module.compile`` keeps ``torch.compile``'s wrapper of the module in ``module._compiled_call_impl``, which
    ``nn.Module.__call__`` calls when set. The engine's compile is adjusted once (an instance ``compile`` that removes
    itself when called, ``engine_state._prepare_module_compile``), the compiled call wrapped, and the wrapper dropped
    to uncompile (a failed compile, Accelerate's regional compiles undone). Written against torch 2.13 and
    DeepSpeed 0.19.8 (``DeepSpeedEngine.compile`` calls ``self.module.compile``)."""
    TARGET = ("torch.nn", "Module", {"compile": None, "_compiled_call_impl": None}, ALL)

    @staticmethod
    def shadow_compile(module: nn.Module, compile_once: Callable) -> None:
        module.compile = compile_once

    @staticmethod
    def unshadow_compile(module: nn.Module) -> None:
        module.__dict__.pop("compile", None)

    @staticmethod
    def compiled_call(module: nn.Module) -> Optional[Callable]:
        return getattr(module, "_compiled_call_impl", None)

    @staticmethod
    def set_compiled_call(module: nn.Module, call: Optional[Callable]) -> None:
        """``call`` in place of the module's compiled call (None: the module runs uncompiled)."""
        module._compiled_call_impl = call


class ZeroBucketReduction:
    """A ZeRO-1/2 optimizer's ``reduce_ipg_grads`` (a full gradient bucket's reduction) and ``setup_buckets``, set on
    the instance to the runtime's (``runtime/z12_reduce.BucketFlush``: the reduction left in flight while backward
    goes on, buckets sized to what they hold); ZeRO's own remain reachable on the class. Written against DeepSpeed
    0.19.8 (``DeepSpeedZeroOptimizer.reduce_ipg_grads(self, comm_dtype=None)``, ``setup_buckets(self)``)."""
    TARGET = ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer",
              {"reduce_ipg_grads": ("comm_dtype", ), "setup_buckets": None}, Z12)

    @staticmethod
    def zero_own(optimizer):
        """ZeRO's own two methods, bound to ``optimizer``: (reduce_ipg_grads, setup_buckets)."""
        cls = type(optimizer)
        return cls.reduce_ipg_grads.__get__(optimizer), cls.setup_buckets.__get__(optimizer)

    @staticmethod
    def install(optimizer, reduce_ipg_grads: Callable, setup_buckets: Callable) -> None:
        optimizer.reduce_ipg_grads = reduce_ipg_grads
        optimizer.setup_buckets = setup_buckets

    @staticmethod
    def remove(optimizer) -> None:
        optimizer.__dict__.pop("reduce_ipg_grads", None)
        optimizer.__dict__.pop("setup_buckets", None)


class ParameterData:
    """A ZeRO-3 parameter's ``.data`` (torch's ``Tensor.data`` setter) swapped for a full-shape stand-in while the
    graphs run (``runtime/standins.py``) and ZeRO's own partitioned ``.data`` put back after, kept on the parameter
    under ``KEPT`` meanwhile. Written against torch 2.13 and DeepSpeed 0.19.8 (a partitioned parameter's ``.data`` is
    an empty tensor; ``ds_shape``, ``ds_tensor``, ``ds_status`` describe it)."""
    TARGET = ("deepspeed.runtime.zero.partition_parameters", "ZeroParamStatus", {"AVAILABLE": None,
                                                                                 "NOT_AVAILABLE": None}, Z3)
    KEPT = "_dsc_partitioned_data"

    @classmethod
    def swap_in(cls, param: nn.Parameter, data: Tensor) -> None:
        setattr(param, cls.KEPT, param.data)
        param.data = data

    @classmethod
    def swap_back(cls, param: nn.Parameter) -> bool:
        """ZeRO's own ``.data`` back; False where no swap was in place."""
        kept = getattr(param, cls.KEPT, None)
        if kept is None:
            return False
        param.data = kept
        setattr(param, cls.KEPT, None)
        return True


class TensorParallelDeferral:
    """An AutoTP layer's ``defer_collectives_to_compiler`` (DeepSpeed's own switch: the layer skips its collectives
    and, run outside a compiled graph, raises instead of computing without them), set while the graphs place the
    collectives (``graph/tensor.py``) and cleared when the engine leaves DeepCompile. Written against DeepSpeed 0.19.8
    (``TensorParallel_Layer.__init__`` sets it False; ``LinearLayer`` and ``LinearAllreduce`` read it in ``forward``,
    ``_assert_compiled_if_deferred`` checks it)."""
    TARGET = ("deepspeed.module_inject.layers", "TensorParallel_Layer", {"_assert_compiled_if_deferred": None}, Z12)

    @staticmethod
    def defer(layers) -> None:
        for layer in layers:
            layer.defer_collectives_to_compiler = True

    @staticmethod
    def restore(layers) -> None:
        for layer in layers:
            layer.defer_collectives_to_compiler = False


ADAPTERS = (ModuleForward, ModuleCompile, ZeroBucketReduction, ParameterData, TensorParallelDeferral)
