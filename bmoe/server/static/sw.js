// A service worker that removes itself. bmoe-server's page registers none; a browser that used
// llama-server's web UI at this address keeps its worker, which would go on showing that UI from its
// cache. Its update check fetches this file: it installs, unregisters, empties the caches and reloads
// the open tabs, which then get this server's page.
self.addEventListener('install', () => self.skipWaiting());
self.addEventListener('activate', (e) => e.waitUntil((async () => {
    await self.registration.unregister();
    for (const key of await caches.keys()) await caches.delete(key);
    for (const c of await self.clients.matchAll({ type: 'window' })) c.navigate(c.url);
})()));
