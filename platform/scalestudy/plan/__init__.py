"""The one planner: a study spec expanded once per command into PlanEntry objects.

Each entry holds the TrialConfig, the resolved hardware, the layout, the Ray resources per worker,
the memory estimate broken into its terms, and a typed verdict (runnable, or infeasible with a
reason class and a one-line reason). validate, predict, run, sweep (both backends, every search),
report and fit read it; none re-derives feasibility. Pure Python: no torch, no ray.
"""

from scalestudy.plan.build import plan_config, plan_point, plan_spec, plan_study
from scalestudy.plan.entry import MemoryEstimate, PlanEntry, Verdict

__all__ = ["MemoryEstimate", "PlanEntry", "Verdict", "plan_config", "plan_point", "plan_spec", "plan_study"]
