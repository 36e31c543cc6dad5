import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


@pytest.mark.slow
def test_every_kernel_compiles_for_h100():
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run([sys.executable, "-m", "tests.kernels.compile_for_h100"], env=env,
                            cwd=Path(__file__).parents[2], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    compiled = [line.split()[0] for line in result.stdout.splitlines()]
    assert compiled == ["_paged_attention_kernel"] * 4 + [
        "_write_kv_cache_kernel", "_rms_norm_kernel", "_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel"]
