"""The part of ``horovod.runner.util`` that Horovod's test utilities import."""
