from router.index import BlockIndex
from router.policy import Candidate, PolicyConfig, ReplicaLoad, RoutingDecision, make_policy
from router.state import RouterState

__all__ = ["BlockIndex", "Candidate", "PolicyConfig", "ReplicaLoad", "RouterState", "RoutingDecision", "make_policy"]
