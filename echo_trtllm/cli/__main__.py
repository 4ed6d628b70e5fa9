from echo_trtllm.cli import main

raise SystemExit(main())
