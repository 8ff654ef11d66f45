"""`bmoe-server`, one model served in four APIs (OpenAI's completions and chat, OpenAI's Responses,
Anthropic's Messages, Ollama's): its decisions and process (`main`), the HTTP app (`app`), each API's
bodies and answer shapes (`openai_wire`, `responses_wire`, `anthropic_wire`, `ollama_wire`, on the
bodies' shared base, `request_base`) and the scheduler that shares the engine among requests.
"""
