"""Requests, scheduling, sampling and the step loop over the model and the radix cache."""
