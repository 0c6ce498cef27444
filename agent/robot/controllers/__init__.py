"""Robot drivers behind one interface (base.Controller); see base.CONTROLLERS for the registry."""

from .base import CONTROLLERS, Command, Controller, ControllerError, make_controller

__all__ = ["CONTROLLERS", "Command", "Controller", "ControllerError", "make_controller"]
