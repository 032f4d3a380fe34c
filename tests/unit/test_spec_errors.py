"""Every bad-input case of `scalestudy validate` exits 2 with one line naming field, value and fix."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scalestudy.spec.errors import SpecError
from scalestudy.spec.load import load_spec
from scalestudy.plan import plan_study

BASE = """\
name: t
model: llama2-tiny
hardware: cpu-local
"""


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "spec.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def _error(tmp_path: Path, text: str, overrides=None) -> str:
    with pytest.raises(SpecError) as exc:
        plan_study(load_spec(_write(tmp_path, text), overrides))
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize(
    "extra, expected",
    [
        ("foo: 1\n", ["foo", "unknown key", "world_size"]),
        ("steps: {warmup: 1, bogus: 2}\n", ["steps.bogus", "unknown key", "measure"]),
        ("zero_stage: 4\n", ["zero_stage", "4", "0, 1, 2, 3"]),
        ("zero_stage: [0, 5]\n", ["zero_stage[1]", "5", "0, 1, 2, 3"]),
        ("world_size: 0\n", ["world_size", "0", "positive"]),
        ("micro_batch: -2\n", ["micro_batch", "-2", "positive"]),
        ("steps: {measure: 0}\n", ["steps.measure", "0", "greater than 0"]),
        ("seq_len: 0\n", ["seq_len", "positive"]),
        ("precision: fp8\n", ["precision", "fp8", "bf16"]),
        ("world_size: 3\ntp: 2\n", ["world_size 3", "tp*pp"]),
        ("world_size: 2\ntp: 2\nmodel: {hidden_size: 48, num_layers: 2, num_heads: 3}\n",
         ["tp 2", "num_heads 3"]),
        ("world_size: 2\ntp: 2\nmodel: {hidden_size: 64, num_layers: 2, num_heads: 4, num_kv_heads: 1}\n",
         ["tp 2", "num_kv_heads 1"]),
        ("world_size: 2\nmicro_batch: 2\nglobal_batch: 6\n", ["global_batch 6", "micro_batch*dp", "4"]),
        # llama2-tiny's max_seq_len is 512; 100000 was once accepted as runnable
        ("seq_len: 100000\n", ["seq_len 100000", "max_seq_len (512)"]),
        ("world_size: 2\ntp: 2\nmodel: {hidden_size: 64, num_layers: 2, num_heads: 4, "
         "ffn_hidden_size: 171}\n", ["tp 2", "ffn_hidden_size 171"]),
        ("world_size: 4\npp: 4\nbackend: simulate\n", ["pp 4", "num_layers 2"]),
        # dims the model factory could not build: refused at load, not on the workers
        ("model: {hidden_size: 100, num_layers: 2, num_heads: 3}\n",
         ["hidden_size 100", "num_heads 3", "divide"]),
        ("model: {hidden_size: 96, num_layers: 2, num_heads: 32}\n", ["head_dim", "3", "even"]),
        ("model: {hidden_size: 64, num_layers: 2, num_heads: 4, num_kv_heads: 3}\n",
         ["num_heads 4", "num_kv_heads 3"]),
        # 10**8 cpu-local workers once "completed" as 5x10**7 nodes
        ("world_size: 100000000\nbackend: simulate\n", ["world_size", "100000000", "1,048,576"]),
        ("world_size: [8, 100000000]\nbackend: simulate\n", ["world_size[1]", "100000000"]),
    ],
)
def test_bad_field(tmp_path, extra, expected):
    base = BASE.replace("model: llama2-tiny\n", "") if "model:" in extra else BASE
    text = base + extra
    msg = _error(tmp_path, text)
    for part in expected:
        assert part in msg, msg


def test_unknown_model(tmp_path):
    msg = _error(tmp_path, BASE.replace("llama2-tiny", "llama9-1b"))
    assert "model" in msg and "llama9-1b" in msg and "llama2-7b" in msg


def test_unknown_hardware(tmp_path):
    msg = _error(tmp_path, BASE.replace("cpu-local", "tpu-v9"))
    assert "hardware" in msg and "tpu-v9" in msg and "h100-80gb" in msg and "calibrate" in msg


def test_missing_required_key(tmp_path):
    msg = _error(tmp_path, "name: t\nhardware: cpu-local\n")
    assert "model" in msg and "missing" in msg


def test_malformed_yaml_has_line_number(tmp_path):
    msg = _error(tmp_path, BASE + "world_size: [1, 2\nzero_stage: 1\n")
    assert "line" in msg and "malformed YAML" in msg


def test_a_spec_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(BASE.encode() + "# pr\xe9cis\n".encode("latin-1"))
    with pytest.raises(SpecError) as exc:
        load_spec(path)
    assert "not UTF-8" in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("content, expected", [
    (b"name: x\xff\n", "not UTF-8"),
    (b"kind: [gpu\n", "malformed YAML"),
    (b"- a list\n", "mapping"),
    (b"kind: gpu\n", "Field required"),
])
def test_a_bad_profile_file_is_one_line(tmp_path, content, expected):
    (tmp_path / "prof.yaml").write_bytes(content)
    msg = _error(tmp_path, BASE.replace("hardware: cpu-local", "hardware: prof.yaml"))
    assert "hardware" in msg and expected in msg, msg


def test_a_folder_is_not_a_spec(tmp_path):
    with pytest.raises(SpecError) as exc:
        load_spec(tmp_path)
    assert "a folder" in str(exc.value)


def test_missing_file(tmp_path):
    with pytest.raises(SpecError) as exc:
        load_spec(tmp_path / "nope.yaml")
    assert "not found" in str(exc.value) and "nope.yaml" in str(exc.value)


def test_bad_override(tmp_path):
    with pytest.raises(SpecError) as exc:
        load_spec(_write(tmp_path, BASE), ["world_size"])
    assert "KEY=VALUE" in str(exc.value)


def test_two_models_of_one_name_are_refused(tmp_path):
    """A name is the model's column everywhere: two custom models whose dims differ beyond the
    auto-name's (architecture, width, depth) must be named apart."""
    dims = "{hidden_size: 64, num_layers: 2, num_heads: %d}"
    msg = _error(tmp_path, BASE.replace("model: llama2-tiny", f"model: [{dims % 4}, {dims % 8}]"))
    assert "custom-llama-h64-l2" in msg and "name each one" in msg
    named = (f"model: [{{name: a, dims: {dims % 4}}}, {{name: b, dims: {dims % 8}}}]")
    assert len(plan_study(load_spec(_write(tmp_path, BASE.replace("model: llama2-tiny", named))))) == 2
    same = BASE.replace("model: llama2-tiny", "model: [llama2-tiny, llama2-tiny]")
    assert load_spec(_write(tmp_path, same)).model[0].name == "llama2-tiny"


def test_two_hardware_profiles_of_one_name_are_refused(tmp_path):
    from scalestudy.spec.catalog import get_hardware, write_profile

    cpu = get_hardware("cpu-local")
    write_profile(cpu.model_copy(update={"hbm_gib": cpu.hbm_gib + 1}), tmp_path / "cal.yaml")
    msg = _error(tmp_path, BASE.replace("hardware: cpu-local", "hardware: [cpu-local, cal.yaml]"))
    assert "cpu-local" in msg and "name:" in msg
    write_profile(cpu, tmp_path / "same.yaml")  # the very same profile twice is one hardware
    spec = load_spec(_write(tmp_path, BASE.replace("hardware: cpu-local",
                                                   "hardware: [cpu-local, same.yaml]")))
    assert {h.name for h in spec.hardware} == {"cpu-local"}


def test_a_value_listed_twice_is_one_trial(tmp_path):
    text = BASE.replace("model: llama2-tiny", "model: [llama2-tiny, llama2-tiny]")
    spec = load_spec(_write(tmp_path, text + "world_size: [2, 1, 2]\nzero_stage: [3, 3]\n"))
    assert spec.world_size == [2, 1] and spec.zero_stage == [3] and len(spec.model) == 1
    trials = plan_study(spec)
    assert len(trials) == len({t.config.trial_id for t in trials}) == 2


def test_a_custom_model_may_not_take_a_catalogue_name(tmp_path):
    model = "model: {name: llama2-7b, dims: {hidden_size: 64, num_layers: 2, num_heads: 4}}"
    msg = _error(tmp_path, BASE.replace("model: llama2-tiny", model))
    assert "llama2-7b" in msg and "catalogue model with other dims" in msg


def test_set_one_dim_of_a_catalogue_model(tmp_path):
    from scalestudy.spec.catalog import get_model

    spec = load_spec(_write(tmp_path, BASE), ["model.hidden_size=128", "model.num_heads=8"])
    (model,) = spec.model
    tiny = get_model("llama2-tiny")
    assert model.dims == tiny.model_copy(update={"hidden_size": 128, "num_heads": 8})
    assert model.name == "custom-llama-h128-l2"


def test_grid_point_infeasible_but_spec_valid(tmp_path):
    planned = plan_study(load_spec(_write(tmp_path, BASE + "world_size: [2, 3]\ntp: 2\n")))
    assert [p.feasible for p in planned] == [True, False]
    assert "world_size 3 is not divisible" in planned[1].reason


def test_cli_exit_code_and_one_line(tmp_path):
    spec = _write(tmp_path, BASE + "zero_stage: 7\n")
    proc = subprocess.run(
        [sys.executable, "-m", "scalestudy.cli", "validate", str(spec)],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "zero_stage" in lines[0] and "Traceback" not in proc.stderr


def test_cli_validate_ok(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "scalestudy.cli", "validate", "experiments/quickstart.yaml"],
        capture_output=True, text=True, cwd=Path(__file__).parents[2],
    )
    assert proc.returncode == 0, proc.stderr
    assert "8 trials (8 runnable, 0 infeasible)" in proc.stdout


def test_elastic_trials_must_keep_the_global_batch_at_every_size():
    from scalestudy.spec.load import validate_spec
    from scalestudy.spec.study import expand

    base = {"name": "el", "model": "llama2-tiny", "hardware": "cpu-local", "world_size": 4,
            "micro_batch": 1, "global_batch": 12}
    ft = {"fault_tolerance": {"max_failures": 1}}  # an elastic trial shrinks by a restart
    ok = expand(validate_spec({**base, **ft, "elastic": {"min_workers": 2, "max_workers": 4}}))[0]
    accum = {w: ok.config.layout.resized(w).grad_accum for w in (2, 3)}
    assert ok.feasible and accum == {2: 6, 3: 4}
    bad = expand(validate_spec({**base, **ft, "global_batch": 8,
                                "elastic": {"min_workers": 2, "max_workers": 4}}))[0]
    assert not bad.feasible and "elastic world size 3" in bad.reason
    with pytest.raises(SpecError, match="min_workers"):
        validate_spec({**base, "elastic": {"min_workers": 3, "max_workers": 2}})


def test_a_search_metric_that_is_no_metric_is_refused(tmp_path):
    msg = _error(tmp_path, BASE + "search: {algorithm: random, metric: tokens_per_sec}\n")
    assert "search.metric" in msg and "tokens_per_sec" in msg and "tokens_per_s_per_device" in msg


@pytest.mark.parametrize("section, valid", [
    ("fault_tolerance: {max_failures: 1}\nelastic: {min_workers: 1, max_workers: 2, bogus: 1}\n",
     "resize_check_s"),
    ("steps: {bogus: 1}\n", "measure"),
])
def test_an_unknown_key_inside_an_optional_section_is_one_line(tmp_path, section, valid):
    msg = _error(tmp_path, BASE + section)
    assert "bogus" in msg and "unknown key" in msg and valid in msg
