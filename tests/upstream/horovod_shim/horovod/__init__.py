"""``horovod`` for running Horovod's own tests against ringcomm: ``horovod.torch`` is
``ringcomm.torch``, and the one runner helper those tests import is provided."""
