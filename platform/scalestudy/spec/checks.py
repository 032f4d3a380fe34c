"""What makes a trial of a valid spec unrunnable beyond its degrees (which the layout checks):
precision, the backend, placement, the pipeline, the layout options, elastic sizes. Each refusal is
an InfeasibleTrial with its ReasonClass; the plan (plan/build.py) records it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scalestudy.errors import InfeasibleTrial, ReasonClass
from scalestudy.parallel.layout import Layout
from scalestudy.spec.catalog import Precision
from scalestudy.spec.trial import (LAYOUT_DEFAULTS, Backend, Elastic, GatherGranularity,
                                   PipelineSchedule, TrialConfig)

if TYPE_CHECKING:
    from scalestudy.spec.study import StudySpec


def check_trial(spec: StudySpec, cfg: TrialConfig) -> None:
    """What makes a trial of a valid spec unrunnable, beyond its degrees (checked by the layout)."""
    hw = cfg.hardware_profile
    cfg.layout.check_model(cfg.model_dims, cfg.seq_len, cfg.virtual_stages,
                           cfg.first_stage_fewer_layers, cfg.last_stage_fewer_layers)
    if cfg.precision not in hw.peak_tflops:
        raise InfeasibleTrial(f"hardware {hw.name} has no {cfg.precision.value} peak figure",
                              ReasonClass.precision)
    if not hw.is_gpu and cfg.precision is Precision.fp16:
        raise InfeasibleTrial("fp16 training needs a GPU; use bf16 or fp32 on CPU",
                              ReasonClass.precision)
    check_pipeline(cfg, measured=spec.backend is Backend.measure)
    check_layout_options(cfg, measured=spec.backend is Backend.measure)
    if spec.backend is Backend.measure:
        # An elastic trial runs at whatever size the cluster holds: the check at its start
        # (launch/placement.py) keeps its TP groups on one node.
        cfg.layout.check_placement(hw.name, whole_nodes=spec.elastic is None)
    if spec.elastic is not None:
        check_elastic(spec.elastic, cfg.layout)


def check_pipeline(cfg: TrialConfig, measured: bool) -> None:
    """What a pipeline (pp > 1) needs beyond its stage split (Layout.check_model): a micro-batch per
    stage at least, a count the interleaved schedule can round, and, measured (train/pipeline.py,
    torch.distributed.pipelining), what the platform's pipeline implements."""
    if cfg.pp == 1:
        return
    m, pp = cfg.grad_accum, cfg.pp
    if m < pp:
        raise InfeasibleTrial(
            f"{m} micro-batch(es) per step (grad_accum) for pp {pp}: a pipeline schedule needs at "
            "least one per stage; raise global_batch or lower micro_batch", ReasonClass.layout)
    rounds = max(1, m // pp)
    if cfg.schedule is PipelineSchedule.interleaved_1f1b and m % rounds:
        raise InfeasibleTrial(
            f"interleaved_1f1b runs micro-batches in rounds of pp {pp}: grad_accum {m} is not a "
            f"multiple of its {rounds} rounds; choose a multiple of pp", ReasonClass.layout)
    if not measured:
        return
    if cfg.zero_stage >= 2:
        raise InfeasibleTrial(
            f"ZeRO-{cfg.zero_stage} with pp {pp}: the schedule runs every micro-batch's backward "
            "apart, so sharded gradients (and, at stage 3, weights) would be reduced (and "
            "gathered) once per micro-batch; pipelines shard optimizer states only (ZeRO-0/1), "
            "as DeepSpeed's and Megatron's do", ReasonClass.backend)
    if cfg.model_dims.architecture != "llama":
        raise InfeasibleTrial(
            f"pp > 1 is measured for llama models only (train/pipeline.py splits Hugging Face "
            f"Llama); {cfg.model} is a {cfg.model_dims.architecture} model", ReasonClass.backend)
    if cfg.precision is Precision.fp16:
        raise InfeasibleTrial("fp16 with pp > 1: the measured pipeline has no loss scaler; use "
                              "bf16 or fp32", ReasonClass.precision)
    if cfg.elastic is not None or cfg.fault_tolerance.max_failures > 0:
        raise InfeasibleTrial("pp > 1 with fault tolerance or elastic sizes: the measured "
                              "pipeline keeps no DeepSpeed checkpoint to resume from; leave "
                              "fault_tolerance.max_failures at 0 and elastic out",
                              ReasonClass.backend)


def check_elastic(el: Elastic, layout: Layout) -> None:
    """Every world size the trial may run at must keep the global batch exactly."""
    if not el.min_workers <= layout.world_size <= el.max_workers:
        raise InfeasibleTrial(f"world_size {layout.world_size} outside elastic "
                              f"[{el.min_workers}, {el.max_workers}]", ReasonClass.elastic)
    for w in range(el.min_workers, el.max_workers + 1):
        try:
            layout.resized(w)
        except InfeasibleTrial as err:
            raise InfeasibleTrial(
                f"elastic world size {w} cannot keep the global batch: {err}; narrow "
                "elastic.min_workers/max_workers or choose a global_batch every size divides",
                ReasonClass.elastic) from None


# hardware.yaml's FP8 dense tensor-core peak (calibration key): the hardware that has FP8 GEMMs.
FP8_PEAK_KEY = "fp8_dense_tflops"


# Layout options the measure backend's trial body runs (train/model_factory.py: selective
# recomputation of the attention core); the others it would run as the default layout, so a
# measured trial that asks for them is refused rather than measured under their name.
MEASURED_OPTIONS = frozenset({"recompute_granularity"})


def check_layout_options(cfg: TrialConfig, measured: bool) -> None:
    """What sequence/context parallelism, gather granularity, TP overlap and FP8 need; measured,
    the trial body runs selective recomputation and none of the others yet."""
    def refuse(why: str, cls: ReasonClass = ReasonClass.layout) -> None:
        raise InfeasibleTrial(why, cls)

    if cfg.sequence_parallel and cfg.tp == 1:
        refuse("sequence_parallel shards the TP group's activations: it needs tp > 1")
    if cfg.tp_comm_overlap and cfg.tp == 1:
        refuse("tp_comm_overlap overlaps TP collectives: it needs tp > 1")
    if cfg.cp > 1 and cfg.dp % cfg.cp:
        refuse(f"cp {cfg.cp} does not divide the {cfg.dp} ranks outside tp x pp (dp x cp)")
    if cfg.cp > 1 and cfg.seq_len % (2 * cfg.cp):
        refuse(f"cp {cfg.cp} splits each sequence into 2 x cp load-balanced chunks: seq_len "
               f"{cfg.seq_len} is not a multiple of {2 * cfg.cp}", ReasonClass.model)
    if cfg.gather_granularity is GatherGranularity.block and cfg.zero_stage != 3:
        refuse(f"gather_granularity block is how ZeRO-3 gathers weights; zero_stage is "
               f"{cfg.zero_stage}: use module (the default)")
    hw = cfg.hardware_profile
    if cfg.fp8 and not hw.calibration.get(FP8_PEAK_KEY):
        refuse(f"fp8: hardware {hw.name} has no FP8 peak ({FP8_PEAK_KEY} in its calibration)",
               ReasonClass.precision)
    if cfg.fp8 and cfg.precision not in (Precision.bf16, Precision.fp16):
        refuse(f"fp8 runs GEMMs in FP8 around a bf16/fp16 model; precision is "
               f"{cfg.precision.value}", ReasonClass.precision)
    if not measured:
        return
    chosen = [k for k, v in LAYOUT_DEFAULTS.items()
              if getattr(cfg, k) != v and k not in MEASURED_OPTIONS]
    if chosen:
        refuse(f"{', '.join(chosen)}: the measure backend's trial body runs the default layout "
               "only (use backend simulate)", ReasonClass.backend)
