from wmtp.cli import main

raise SystemExit(main())
