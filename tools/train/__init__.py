"""Training and fitting what the robot and the server load: exits, the predictor, the estimator."""
