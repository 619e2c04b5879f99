"""kvpool agent: streams connector and pool state over ZMQ and executes operator commands."""
