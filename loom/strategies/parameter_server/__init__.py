"""Asynchronous parameter-server training: placement, wire format, servers, clients, the strategy, its coordinator."""

from loom.strategies.parameter_server.coordinator import ClusterCoordinator, RemoteValue
from loom.strategies.parameter_server.server import ParameterServer
from loom.strategies.parameter_server.strategy import ParameterServerStrategy

__all__ = ["ClusterCoordinator", "ParameterServer", "ParameterServerStrategy", "RemoteValue"]
