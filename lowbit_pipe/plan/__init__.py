"""Which format each layer gets, and why: rules and fallbacks (policy), the byte budget, quantize.target and its
solver with the speed / error models behind it, calibration statistics, what loads where, whether a run streams."""
