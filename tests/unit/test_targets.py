"""The target registry (llmc.targets): each runtime's record, looked up by the planner, build, inspect and docs."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmc import targets
from llmc.errors import IncompatibleTargetError
from llmc.quant.spec import Scheme, TensorSpec
from llmc.recipe.schema import Target

W4_G32 = Scheme(TensorSpec("int4", "group", group_size=32))


def test_exllamav2_target_gets_gptq_checkpoints_on_cuda_only() -> None:
    from llmc.plan import check_target

    rt = targets.runtime("exllamav2")
    assert rt.format == "gptq" and targets.format_for(Target(runtime="exllamav2")).name == "gptq"
    assert check_target(W4_G32, Target(runtime="exllamav2", gpu_arch="sm80"))[0] == "native"
    with pytest.raises(IncompatibleTargetError, match="no CPU support"):
        check_target(W4_G32, Target(runtime="exllamav2", gpu_arch="cpu"))
    with pytest.raises(IncompatibleTargetError, match="does not run W8A8-FP8"):
        check_target(Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "tensor")),
                     Target(runtime="exllamav2", gpu_arch="sm90"))
    with pytest.raises(IncompatibleTargetError, match="triton"):
        check_target(W4_G32, Target(runtime="exllamav2", gpu_arch="sm80", triton=True))
    assert "exllamav2" in Path("docs/compatibility.md").read_text()
