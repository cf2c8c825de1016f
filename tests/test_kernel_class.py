"""Kernel's class rules, kept by ``Kernel.__init_subclass__`` (no metaclass): ``run`` and
``supports`` are final, ``compile`` is wrapped so that the requested cc reaches provider helpers,
also for methods assigned after the class was created (as notebooks do); abstract methods
still keep incomplete classes from being instantiated. CPU only: nothing is compiled."""

from __future__ import annotations

import abc

import pytest
import torch

import kernel_api
from kernel_api import CompilationError, CompiledArtifact, GemmArguments, Kernel, registry
from kernel_api.kernel import compile_target_cc
from toy_kernels import ToyGemm, ToyProvider


def _metadata():
    found = ToyGemm.generate_kernels(lambda m: m.operands.A.dtype.name == "f32" and m.operands.A.divisibility == 1)
    return next(k for k in found if "ttt" in k.metadata.kernel_name).metadata  # min_cc=80


def _args():
    return GemmArguments(torch.randn(8, 4), torch.randn(4, 6), torch.empty(8, 6))


def _recording_compile(seen):
    def compile(self, args, cc=None):
        seen.append((cc, compile_target_cc.get()))
        return CompiledArtifact("compiled", self)

    return compile


def test_kernel_has_no_metaclass_of_its_own():
    assert type(Kernel) is abc.ABCMeta and type(ToyGemm) is abc.ABCMeta
    assert not hasattr(kernel_api.kernel, "KernelMeta")


def test_a_compile_defined_in_the_class_body_reaches_the_cc_context():
    seen = []

    class Body(ToyGemm):
        compile = _recording_compile(seen)

    artifact = Body(_metadata()).compile(_args(), cc="sm_90a")
    assert seen == [(90, 90)] and artifact.cc == 90
    with pytest.raises(CompilationError, match="cannot compile for compute capability 75"):
        Body(_metadata()).compile(_args(), cc=75)  # the metadata says 80 and newer
    assert len(seen) == 1


def test_a_compile_assigned_after_the_class_is_created_is_wrapped_when_it_is_instantiated():
    seen = []

    class Late(ToyGemm):
        pass

    Late.compile = _recording_compile(seen)
    kernel = Late(_metadata())
    artifact = kernel.compile(_args(), cc=90)
    assert seen == [(90, 90)] and artifact.cc == 90 and artifact.kernel is kernel
    assert kernel.compile(_args()) is not None and seen[-1] == (None, None)  # no cc: none set
    with pytest.raises(CompilationError, match="compute capability 75"):
        kernel.compile(_args(), cc=75)
    # Assigned again after instances exist: wrapped when the next one is made.
    Late.compile = _recording_compile(seen)
    Late(_metadata())
    assert kernel.compile(_args(), cc=90).cc == 90 and seen[-1] == (90, 90)


def test_a_compile_assigned_after_discovery_is_wrapped_when_discovery_runs_again():
    """A notebook re-running the cell that assigns compile, then asking get_kernels again (which
    answers from its caches): the instances it returns compile with the requested cc."""

    class Rerun(ToyGemm):
        @staticmethod
        def generate_kernels(metadata_filter, epilogue_args=None, cc=None):
            md = _metadata()
            return [Rerun(kernel_api.KernelMetadata("Rerun_" + md.kernel_name, Rerun, md.operands, md.design,
                                                    min_cc=80))]

    ToyProvider.register(Rerun)
    try:
        args = _args()
        only = dict(metadata_filter=lambda m: m.kernel_class is Rerun, cc=90)
        kernels = kernel_api.get_kernels(args, **only)
        assert len(kernels) == 1
        seen = []
        Rerun.compile = _recording_compile(seen)
        again = kernel_api.get_kernels(args, **only)
        assert again[0] is kernels[0]  # from the caches: no new instance was made
        assert kernels[0].compile(args, cc=90).cc == 90 and seen == [(90, 90)]
    finally:
        ToyProvider.unregister(Rerun)
        registry.unregister_provider("toy")


def test_run_and_supports_are_final_in_the_class_body():
    for name in ("run", "supports"):
        with pytest.raises(TypeError, match=rf"Body.{name} is final: implement _{name} instead"):
            type("Body", (ToyGemm,), {name: lambda self, *a, **k: None})


def test_run_or_supports_assigned_after_the_class_is_created_are_refused_when_it_is_instantiated():
    for name in ("run", "supports"):
        class Late(ToyGemm):
            pass

        setattr(Late, name, lambda self, *a, **k: None)
        with pytest.raises(TypeError, match=rf"Late.{name} is final: implement _{name} instead"):
            Late(_metadata())
        delattr(Late, name)
        Late(_metadata())  # fine again without it


def test_a_run_assigned_to_a_registered_class_is_refused_by_discovery():
    class LateRun(ToyGemm):
        @staticmethod
        def generate_kernels(metadata_filter, epilogue_args=None, cc=None):
            return []

    ToyProvider.register(LateRun)
    try:
        LateRun.run = lambda self, *a, **k: None
        with pytest.raises(TypeError, match="LateRun.run is final"):
            kernel_api.get_kernels(_args(), cc=90)
    finally:
        del LateRun.run
        ToyProvider.unregister(LateRun)
        registry.unregister_provider("toy")


def test_abstract_methods_still_keep_incomplete_classes_from_being_instantiated():
    class Half(Kernel):
        def compile(self, args, cc=None):
            return None

    assert Half.__abstractmethods__ == frozenset({"_run", "generate_kernels", "_supports", "get_workspace_size"})
    with pytest.raises(TypeError, match="abstract"):
        Half(_metadata())
