"""``python -m kvcache.kernels [--every-variant | --selected]``: compile every kernel library ahead of use
(kernels/build.py's ``main``)."""

from kvcache.kernels.build import main

raise SystemExit(main())
