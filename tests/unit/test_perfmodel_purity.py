"""scalestudy.perfmodel imports and predicts with torch and ray unavailable (pure Python)."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
sys.modules['torch'] = None
sys.modules['ray'] = None
sys.modules['deepspeed'] = None
import scalestudy.perfmodel.predict, scalestudy.perfmodel.fit, scalestudy.perfmodel.memory
from scalestudy.spec.load import validate_spec
from scalestudy.spec.study import expand
(p,) = expand(validate_spec({"name": "t", "model": "llama2-7b", "hardware": "h100-80gb",
                             "world_size": 64, "zero_stage": 3, "seq_len": 4096}))
r = scalestudy.perfmodel.predict.predict(p.config)
assert r.status.value == "completed" and r.tokens_per_s > 0
print("ok")
"""


def test_perfmodel_needs_neither_torch_nor_ray():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")
