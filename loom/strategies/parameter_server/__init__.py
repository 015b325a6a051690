"""Asynchronous parameter-server training: placement, wire format, servers, clients, the strategy."""

from loom.strategies.parameter_server.server import ParameterServer
from loom.strategies.parameter_server.strategy import ParameterServerStrategy

__all__ = ["ParameterServer", "ParameterServerStrategy"]
