"""`bmoe-server`, the OpenAI-compatible server: its decisions and process (`main`), the HTTP app
(`app`), the OpenAI shapes (`wire`) and the scheduler that shares the engine among requests.
"""
