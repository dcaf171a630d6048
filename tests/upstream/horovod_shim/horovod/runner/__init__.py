"""The part of ``horovod.runner`` that Horovod's test utilities import."""
