"""What users run besides the one-shot CLI: its flags (`flags`, generated from the settings),
the notice and error lines (`console`), exit codes and signals (`exits`), the --profile table
(`profile`), and session mode (`session`, its line protocol `protocol`, and `session_client`, a
driver for apps and tests).
"""
