"""The robot application: the `edge-agent` CLI, the daemon, its local API and configuration, the
navigation loop, telemetry and episodes. It drives a decoder from `agent.decoding` and the robot in
`agent.robot`.
"""
