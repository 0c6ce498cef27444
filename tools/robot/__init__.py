"""Evaluation of the robot: navigation over scenes, the prompt, its memory's cost."""
