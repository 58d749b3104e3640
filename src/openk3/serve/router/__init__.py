"""``openk3 route``: cache-aware routing of OpenAI requests across several ``openk3 serve`` workers.

``config`` (:class:`RouterConfig`), ``hash_ring`` (consistent hashing), ``prefix_index`` (the router's
approximate copy of each worker's prefix cache), ``policy`` (the decision), ``metrics`` (Prometheus) and
``app`` (HTTP, retries, health probes, streaming). User guide: ``docs/fleet.md``.
"""

from openk3.serve.router.config import RouterConfig
from openk3.serve.router.hash_ring import HashRing
from openk3.serve.router.policy import RoutingPolicy

__all__ = ["HashRing", "RouterConfig", "RoutingPolicy", "build_router_app"]


def build_router_app(config: RouterConfig, transport=None):
    """The FastAPI app of a router (imports FastAPI and httpx when called)."""
    from openk3.serve.router.app import build_router_app as build

    return build(config, transport)
