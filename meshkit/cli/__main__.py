from meshkit.cli.main import main

raise SystemExit(main())
