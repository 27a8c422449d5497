from fleetd.cli.main import main

raise SystemExit(main())
