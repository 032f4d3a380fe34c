"""Which figures head a paper study follows from what its spec sweeps."""

from __future__ import annotations

from scalestudy_analysis.figures import BY_NAME
from scalestudy_analysis.headline import RULES, headline_figures


def test_headline_follows_the_swept_axis():
    assert headline_figures({"name": "fsdp_scaling", "world_size": [8, 16, 32]}) == (
        "throughput_scaling", "step_time_breakdown")
    assert headline_figures({"name": "x", "world_size": 2048, "tp": [1, 2], "pp": [1, 4]}) == (
        "parallelism_degrees",)
    assert headline_figures({"name": "gens", "hardware": ["v100-32gb", "h100-80gb"],
                             "world_size": [8, 64]})[0] == "hardware_generations"
    assert headline_figures({"name": "workload", "micro_batch": [1, 2, 4]}) == (
        "workload_utilization",)
    # the energy study sweeps world size and models too; its point is energy
    assert headline_figures({"name": "power_study", "world_size": [8, 64],
                             "model": ["llama2-7b", "llama2-70b"]})[0] == "power_scaling"
    assert headline_figures({"name": "sizes", "model": ["llama2-7b", "llama2-70b"]}) == (
        "model_size",)
    assert headline_figures({"name": "single", "world_size": [8]}) == ("trial_overview",)


def test_every_rule_names_a_registered_figure():
    assert all(name in BY_NAME for _, figures in RULES for name in figures)
