from router.core import Router
from router.index import BlockIndex
from router.messages import FinishedRequest, ReplicaSnapshot, RouterSnapshot, RoutingDecision
from router.policy import Candidate, PolicyConfig, RequestShape, make_policy

__all__ = ["BlockIndex", "Candidate", "FinishedRequest", "PolicyConfig", "ReplicaSnapshot", "RequestShape", "Router",
           "RouterSnapshot", "RoutingDecision", "make_policy"]
