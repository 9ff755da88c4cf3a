from kvcache.cli import main

raise SystemExit(main())
