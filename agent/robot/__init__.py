"""The robot side of the agent: actions, the safety layer, controllers, camera, perception, the simulator."""
