"""`bmoe-server`, one model served in five APIs (OpenAI's completions and chat, OpenAI's Responses,
Anthropic's Messages, Ollama's, llama-server's native one): its decisions and process (`main`), the
HTTP app (`app`, and `llama_routes` for llama-server's paths), each API's bodies and answer shapes
(`openai_wire`, `responses_wire`, `anthropic_wire`, `ollama_wire`, `llama_wire`, on the bodies' shared
base, `request_base`) and the scheduler that shares the engine among requests.
"""
