from mpilb.cli.main import main

raise SystemExit(main())
