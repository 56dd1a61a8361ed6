"""Latency targets: a deployment's measured step times, what they are valid for, how they are measured."""
