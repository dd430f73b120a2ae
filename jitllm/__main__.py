from jitllm.cli import main

main()
