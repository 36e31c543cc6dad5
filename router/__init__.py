from router.index import BlockIndex
from router.messages import FinishedRequest, RouterSnapshot, RoutingDecision
from router.policy import Candidate, PolicyConfig, ReplicaLoad, make_policy
from router.state import RouterState

__all__ = ["BlockIndex", "Candidate", "FinishedRequest", "PolicyConfig", "ReplicaLoad", "RouterSnapshot", "RouterState", "RoutingDecision",
           "make_policy"]
