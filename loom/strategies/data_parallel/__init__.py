"""Strategies that keep a whole copy of the model on every replica and average gradients (or, for
local SGD and DiLoCo, parameters)."""
