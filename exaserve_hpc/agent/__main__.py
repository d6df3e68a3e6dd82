from exaserve_hpc.agent.node_agent import main
import sys

sys.exit(main())
