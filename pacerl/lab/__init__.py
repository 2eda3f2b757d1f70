"""The lab: the simulator of the asynchronous pipeline at cluster scale (`pacerl simulate`) and the
calibration of the publication interval and the learning rate (`pacerl calibrate`). It sits above
`trainer/` and runs the pool's own code; nothing below imports it. This file imports nothing, so that
building the `pacerl` parser stays light."""
