"""How much to speculate: every place the engine sizes trees by what they are expected to commit per second.

`goodput`: the `GoodputController`, which plans each `Adaptive` row's draft depth and selects the nodes worth
verifying across the batch, step by step, with its calibration of the drafters' probabilities; `step_cost`: T(N),
the target forward's cost it prices with, timed once per target and then learned from the steps; `sizing`: the
offline model `specgraft tune-tree` sizes one static tree with (`size_tree`, from measured acceptance and costs);
`clock`: the device's seconds of a forward (CUDA events on a GPU), which both time T(N) with.
"""

from specgraft.infer.adaptive.goodput import Candidate, GoodputController
from specgraft.infer.adaptive.sizing import TreeChoice, interpolate, size_tree
from specgraft.infer.adaptive.step_cost import StepCost, forget_step_cost, step_cost

__all__ = ["Candidate", "GoodputController", "StepCost", "TreeChoice", "forget_step_cost", "interpolate", "size_tree",
           "step_cost"]
