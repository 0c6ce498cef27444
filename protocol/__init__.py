"""What the robot and the server share: the wire, the sampling maths, the payload codecs, model names.

numpy, msgpack and the standard library only, so `agent/` imports it without torch
and without anything of `server_bridge/`.
"""
