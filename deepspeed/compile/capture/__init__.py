"""Capture: let dynamo/AOTAutograd trace ZeRO-3 parameters with full shapes, and build the dynamo backend."""
