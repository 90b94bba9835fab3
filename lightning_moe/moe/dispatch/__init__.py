"""Token dispatchers: move routed rows to the rank that holds their expert and back.

The MoE layer holds one dispatcher object in its plan (:mod:`lightning_moe.moe.layer_plan`); parallelize gives it
a distributed one. The contract every dispatcher keeps, including who applies the combine weights, is in
:mod:`~lightning_moe.moe.dispatch.base`.

=============  ==============================================================================================
module         what
=============  ==============================================================================================
``base``       ``TokenDispatcher``, ``DispatchContext``, ``weights_applied_by``
``rows``       gather-only autograd row movement (permute / unpermute / row weights)
``layout``     index math: rows sorted by expert, capacity / aligned slots, the regroup index
``local``      ``LocalDispatcher``: every expert on this process
``groups``     process groups and the ep / etp bookkeeping of the distributed dispatchers
``alltoall``   ``AllToAllDispatcher``: all-to-all over ep (+ all-gather / reduce-scatter over etp)
``allgather``  ``AllGatherDispatcher``: the tokens all-gathered over ep and etp
``deepep``     ``DeepEPDispatcher``: DeepEP's intranode kernels (optional; deep_ep imported on first use)
=============  ==============================================================================================
"""

from lightning_moe.moe.dispatch.allgather import AllGatherDispatcher
from lightning_moe.moe.dispatch.alltoall import AllToAllDispatcher
from lightning_moe.moe.dispatch.base import (
    WEIGHTS_APPLIED_BY,
    DispatchContext,
    TokenDispatcher,
    WeightsAppliedBy,
    check_weights_applied_by,
)
from lightning_moe.moe.dispatch.deepep import DeepEPDispatcher
from lightning_moe.moe.dispatch.groups import GroupLike
from lightning_moe.moe.dispatch.layout import regroup_index
from lightning_moe.moe.dispatch.local import LocalDispatcher

__all__ = ["AllGatherDispatcher", "AllToAllDispatcher", "DeepEPDispatcher", "DispatchContext", "GroupLike",
           "LocalDispatcher", "TokenDispatcher", "WEIGHTS_APPLIED_BY", "WeightsAppliedBy", "check_weights_applied_by",
           "regroup_index"]
