from .node_agent import main
import sys

sys.exit(main())
