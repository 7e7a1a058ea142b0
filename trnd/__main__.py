from trnd.cli import main

raise SystemExit(main())
