// Validate custom resources against the CRD schemas their projects publish, as packaged by
// kubernetes-models (npm): reads a JSON array of objects on stdin, prints one JSON verdict per
// object. Used by validate.py; not meant to be run alone.
import fs from "fs";
import { ScaledObject, TriggerAuthentication } from "@kubernetes-models/keda/keda.sh/v1alpha1";
import { PodMonitor, PrometheusRule, ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1";

const models = {
  "keda.sh/v1alpha1": { ScaledObject, TriggerAuthentication },
  "monitoring.coreos.com/v1": { PodMonitor, PrometheusRule, ServiceMonitor },
};
const verdicts = JSON.parse(fs.readFileSync(0, "utf8")).map((doc) => {
  const Model = (models[doc.apiVersion] || {})[doc.kind];
  if (!Model) return { ok: false, error: `no published schema for ${doc.apiVersion} ${doc.kind}` };
  try {
    new Model(doc).validate();
    return { ok: true };
  } catch (e) {
    return { ok: false, error: String(e.message) };
  }
});
process.stdout.write(JSON.stringify(verdicts));
